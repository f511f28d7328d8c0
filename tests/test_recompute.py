"""Activation recompute (``model.recompute``): bit-identical to no recompute, FP8 state included,
and it really drops activations (CPU, seconds)."""

from __future__ import annotations

import pytest
import torch

from fp8train.convert import lower_linear_weights
from fp8train.param_state import grad_slot
from fp8train.precision import get_recipe
from models.context import BuildContext
from models.gpt import GPTConfig, GPTModel
from models.transformer import TransformerConfig, TransformerLayer
from parallel.tensor_parallel.random import get_tracker, model_parallel_seed

V, S = 64, 16


def build(level: str, recompute: str, dropout: float = 0.0) -> GPTModel:
    torch.manual_seed(0)
    cfg = GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=S,
        vocab_size=V,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        recompute=recompute,
    )
    model = GPTModel(cfg, BuildContext(get_recipe(level)))
    lower_linear_weights(model)  # O1-O3: scaled FP16/FP8 weights with FP8 grad slots
    return model


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (2, S), generator=g), torch.randint(0, V, (2, S), generator=g)


def two_passes(model: GPTModel) -> dict[str, torch.Tensor]:
    """Two forward+backward passes of 2 micro-batches each (grads accumulate, no optimizer): the
    second pass casts with delayed scales from the first one's history."""
    torch.manual_seed(1234)  # dropout draws
    out = {}
    for step in range(2):
        for mb in range(2):
            tokens, labels = batch(10 * step + mb)
            loss = model(tokens, labels=labels).mean()
            loss.backward()
            out[f"loss{step}.{mb}"] = loss.detach()
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[f"grad:{name}"] = p.grad
        slot = grad_slot(p)
        if slot is not None:
            out[f"slot:{name}"] = slot.dequantize()
    for key, value in model.state_dict().items():  # FP8 amax histories, scales, steps, ...
        out[f"state:{key}"] = value
    return out


def assert_identical(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, different


@pytest.mark.parametrize("recompute", ["full", "selective"])
@pytest.mark.parametrize(
    ("level", "dropout"), [("fp32", 0.0), ("te", 0.0), ("O2", 0.0), ("fp32", 0.1), ("te", 0.1)]
)
def test_recompute_is_bit_identical(level, dropout, recompute):
    want = two_passes(build(level, "none", dropout))
    got = two_passes(build(level, recompute, dropout))
    assert_identical(got, want)
    if level == "O2":  # the FP8 gradient slots saw each micro-batch exactly once
        assert any(k.startswith("slot:") for k in want)
    if level == "te":
        assert want["state:layers.0.attention.qkv.fp8_input.step"] == 4  # one update per forward


@pytest.fixture
def tracker():
    yield model_parallel_seed(7, tp_rank=0)
    get_tracker().reset()
    torch.manual_seed(0)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_replays_tensor_parallel_dropout_stream(tracker, recompute):
    """Sharded attention dropout draws from the TP tracker's stream (forked inside the
    recomputed region): the recompute must redraw the original masks and leave the stream
    where the forward left it."""
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4)
    results = []
    for mode in ("none", recompute):
        torch.manual_seed(0)
        layer = TransformerLayer(cfg, BuildContext(get_recipe("te")), recompute=mode)
        layer.attention.tp_sharded = True  # as on a TP rank, without a process group
        tracker.set_states(model_parallel_seed(7, tp_rank=0).get_states())
        x = torch.randn(2, S, 32, requires_grad=True)
        torch.manual_seed(5)
        y = layer(x)
        y.square().sum().backward()
        grads = [x.grad] + [p.grad for p in layer.parameters()]
        results.append((y.detach(), grads, tracker.get_states()))
    (y0, g0, s0), (y1, g1, s1) = results
    assert torch.equal(y0, y1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert all(torch.equal(s0[k], s1[k]) for k in s0)


def test_recompute_config_validation():
    with pytest.raises(ValueError, match="model.recompute"):
        build("fp32", "partial")
    with pytest.raises(ValueError, match="model.recompute"):
        TransformerLayer(
            TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4), recompute="Full"
        )


def saved_bytes(model: GPTModel) -> int:
    """Bytes autograd keeps for backward after one forward (each storage counted once)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    tokens, labels = batch(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, labels=labels).mean()
    return sum(storages.values())


@pytest.mark.parametrize("level", ["fp32", "te"])
def test_recompute_frees_activations(level):
    """Attention dropout keeps the [b, heads, s, s] probabilities (SDPA's math path), the part
    selective recompute targets. The hooks see only tensors saved outside checkpointed regions
    (inside, checkpoint's own hooks take over); a full-recompute layer keeps just its input."""
    none, full, selective = (
        saved_bytes(build(level, mode, dropout=0.1)) for mode in ("none", "full", "selective")
    )
    print(f"{level}: saved bytes none={none} selective={selective} full={full}")
    assert full < none / 4
    assert selective < none
