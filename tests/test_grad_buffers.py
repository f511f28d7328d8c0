"""GradBuffers in one process: storage, bucket plan, accumulation and readiness.

(i) Every high-precision ``main_grad`` is a view of one flat FP32 buffer and every O1-O3 FP8
gradient slot a view of the flat FP8 buffer (its ``scale_inv`` and ``amax`` of their regions),
without overlap; (ii) buckets follow reverse registration order per dtype and close at
``bucket_size`` elements, the held parameters in a last bucket of their own; (iii) ``zero_``
clears everything; (iv) accumulating micro-batches into the buffers gives bitwise what plain
autograd accumulation gives (FP32 ``.grad``), what an unbound FP8 slot gives (O2), and the FP32
sum of the BF16 micro-batch gradients (bf16); (v) a parameter becomes ready only after its
``n_micro``-th accumulation, buckets launch in their fixed order as they fill and the held one
only in ``finish``, after ``before_held``. The data-parallel collectives themselves are
exercised on real gloo groups in tests/test_distributed_optimizer.py.
"""

from __future__ import annotations

import pytest
import torch

from fp8train.convert import apply_level_storage
from fp8train.low_precision import Fp8GradSlot
from fp8train.param_state import grad_slot
from fp8train.precision import get_recipe
from models.context import BuildContext
from models.gpt import GPTConfig, GPTModel
from parallel.grad_buffer import GradBuffers, default_bucket_size

VOCAB, SEQ = 64, 16


def _model(level: str) -> GPTModel:
    torch.manual_seed(0)
    config = GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        seq_length=SEQ,
        vocab_size=VOCAB,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    recipe = get_recipe(level)
    return apply_level_storage(GPTModel(config, BuildContext(recipe)), recipe)


def _params(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(n)]


def _backward(model, tokens, n_micro: int) -> None:
    (model(tokens, labels=tokens).float().mean() / n_micro).backward()


def _is_view_of(t: torch.Tensor, base: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def _offset(t: torch.Tensor, base: torch.Tensor) -> int:
    return (t.data_ptr() - base.data_ptr()) // t.element_size()


def test_default_bucket_size_is_megatrons():
    assert default_bucket_size(1) == 40_000_000
    assert default_bucket_size(64) == 64_000_000


@pytest.mark.parametrize("level", ["fp32", "bf16", "O2"])
def test_gradients_are_views_of_two_flat_buffers(level):
    model = _model(level)
    params = _params(model)
    buffers = GradBuffers(params, bucket_size=5000)
    fp32_spans, fp8_spans, slot_indices = [], [], []
    for p in params:
        grad = grad_slot(p)
        if isinstance(grad, Fp8GradSlot):
            assert grad.data.dtype == torch.float8_e4m3fn and grad.shape == p.shape
            assert _is_view_of(grad.data, buffers.fp8)
            fp8_spans.append((_offset(grad.data, buffers.fp8), p.numel()))
            assert _is_view_of(grad.scale_inv, buffers.scale_inv)
            assert _is_view_of(grad.amax, buffers.amax)
            slot_indices.append(_offset(grad.scale_inv, buffers.scale_inv))
            assert _offset(grad.amax, buffers.amax) == slot_indices[-1]
        else:
            # FP32 whatever the parameter's dtype: BF16 gradients accumulate in FP32.
            assert grad.dtype == torch.float32 and grad.shape == p.shape
            assert _is_view_of(grad, buffers.fp32)
            fp32_spans.append((_offset(grad, buffers.fp32), p.numel()))
    # Disjoint regions covering each buffer exactly (one replica: no padding).
    for spans, buffer in ((fp32_spans, buffers.fp32), (fp8_spans, buffers.fp8)):
        end = 0
        for offset, n in sorted(spans):
            assert offset == end
            end += n
        assert end == buffer.numel()
    assert sorted(slot_indices) == list(range(len(slot_indices)))
    assert len(slot_indices) == (8 if level == "O2" else 0)  # 4 linear weights per layer
    assert bool(fp32_spans)


def test_buckets_follow_reverse_order_per_dtype_and_hold_back():
    model = _model("O2")
    params = _params(model)
    held = model.word_embeddings.weight
    size = 600  # FP32: 1408 elements in 2+ buckets; FP8: weights of 1024+ alone
    buffers = GradBuffers(params, bucket_size=size, held={id(held)})
    *regular, last = buffers.buckets
    assert last.held and last.params == [held]
    assert not any(b.held for b in regular)
    order = {id(p): i for i, p in enumerate(params)}
    for fp8 in (False, True):
        buckets = [b for b in regular if b.fp8 == fp8]
        members = [p for b in buckets for p in b.params]
        # Reverse registration order, every parameter of the dtype exactly once.
        expected = [p for p in reversed(params) if p is not held]
        expected = [p for p in expected if isinstance(grad_slot(p), Fp8GradSlot) == fp8]
        assert [order[id(p)] for p in members] == [order[id(p)] for p in expected]
        for bucket in buckets[:-1]:  # closed as soon as it reached bucket_size
            sizes = [p.numel() for p in bucket.params]
            assert sum(sizes) >= size > sum(sizes[:-1])
        assert len(buckets) >= 2
    # Storage follows bucket order: each bucket's parameters are contiguous in its buffer.
    for bucket in buffers.buckets:
        base = buffers.fp8 if bucket.fp8 else buffers.fp32
        offset = bucket.offset
        for p in bucket.params:
            grad = grad_slot(p).data if bucket.fp8 else grad_slot(p)
            assert _offset(grad.view(torch.uint8) if bucket.fp8 else grad, base) == offset
            offset += p.numel()


def test_zero_clears_both_buffers():
    model = _model("O2")
    buffers = GradBuffers(_params(model), bucket_size=5000)
    buffers.start_step(1)
    _backward(model, _batches(1)[0], 1)
    buffers.finish()
    slots = [grad_slot(p) for p in _params(model) if isinstance(grad_slot(p), Fp8GradSlot)]
    assert buffers.fp32.abs().sum() > 0 and buffers.fp8.any()
    assert all(s.has_data for s in slots)
    buffers.zero_()
    assert not buffers.fp32.any() and not buffers.fp8.any() and not buffers.amax.any()
    assert torch.equal(buffers.scale_inv, torch.ones_like(buffers.scale_inv))
    assert not any(s.has_data for s in slots)


@pytest.mark.parametrize("level", ["fp32", "O2"])
def test_accumulation_equals_plain_autograd(level):
    """Three micro-batches: the buffers' FP32 views hold bitwise the ``.grad`` autograd
    accumulates, and the bound FP8 slots bitwise what unbound slots accumulate."""
    n_micro = 3
    batches = _batches(n_micro)
    with_buffers, plain = _model(level), _model(level)
    params, ref = _params(with_buffers), _params(plain)
    buffers = GradBuffers(params, bucket_size=5000)
    buffers.start_step(n_micro)
    for tokens in batches:
        _backward(with_buffers, tokens, n_micro)
        _backward(plain, tokens, n_micro)
        assert all(p.grad is None for p in params)  # moved into main_grad and freed
    buffers.finish()
    for p, r in zip(params, ref):
        if isinstance(grad_slot(p), Fp8GradSlot):
            assert torch.equal(
                grad_slot(p).data.view(torch.uint8), grad_slot(r).data.view(torch.uint8)
            )
            assert torch.equal(grad_slot(p).scale_inv, grad_slot(r).scale_inv)
            assert torch.equal(grad_slot(p).amax, grad_slot(r).amax)
        else:
            assert torch.equal(grad_slot(p), r.grad)


def test_bf16_gradients_accumulate_in_fp32():
    n_micro = 3
    batches = _batches(n_micro)
    model, ref = _model("bf16"), _model("bf16")
    params = _params(model)
    buffers = GradBuffers(params, bucket_size=5000)
    buffers.start_step(n_micro)
    sums = [torch.zeros(p.shape) for p in params]
    for tokens in batches:
        _backward(model, tokens, n_micro)
        for r in _params(ref):
            r.grad = None
        _backward(ref, tokens, n_micro)
        for total, r in zip(sums, _params(ref)):
            assert r.grad.dtype == torch.bfloat16
            total += r.grad.float()
    buffers.finish()
    for p, total in zip(params, sums):
        assert torch.equal(grad_slot(p), total)
    # A BF16 running sum would have rounded: the FP32 one keeps bits BF16 cannot hold.
    assert any(not torch.equal(t, t.bfloat16().float()) for t in sums)


def test_ready_after_the_last_micro_batch_in_fixed_bucket_order():
    """One process has nothing to send, so overlap is off there; switched on by hand, the hooks'
    bookkeeping runs as on a data-parallel rank (``_launch`` then only logs)."""
    model = _model("O2")
    params = _params(model)
    held = model.word_embeddings.weight
    buffers = GradBuffers(params, bucket_size=3000, held={id(held)})
    assert not buffers.overlap  # world 1
    buffers.overlap = True
    batches, calls = _batches(3), []
    for _ in range(2):  # the bookkeeping is reset between steps
        buffers.start_step(3)
        for tokens in batches[:2]:
            _backward(model, tokens, 3)
        assert buffers.launch_log == []  # no parameter has all 3 accumulations yet
        _backward(model, batches[2], 3)
        regular = len(buffers.buckets) - 1
        launched = [b for b, _ in buffers.launch_log]
        assert launched == list(range(regular))  # every regular bucket, in order
        pending = [n for _, n in buffers.launch_log]
        assert pending[0] > 0 and pending == sorted(pending, reverse=True)
        # Left pending at the last launch: at most the held embedding (its lookup gradient
        # arrives last); ready or not, its bucket waits for finish.
        assert pending[-1] <= 1
        calls.clear()
        buffers.finish(before_held=lambda: calls.append(len(buffers.launch_log)))
        assert calls == [regular]  # before the held bucket's launch
        assert [b for b, _ in buffers.launch_log] == list(range(regular + 1))
        buffers.zero_()


def test_without_overlap_everything_launches_in_finish():
    model = _model("O2")
    buffers = GradBuffers(_params(model), bucket_size=3000)
    buffers.start_step(1)
    _backward(model, _batches(1)[0], 1)
    assert buffers.launch_log == []
    buffers.finish()
    assert buffers.launch_log == [(b.index, 0) for b in buffers.buckets]
