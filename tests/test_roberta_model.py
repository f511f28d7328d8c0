"""RoBERTa encoder: Hugging Face ``RobertaForMaskedLM`` logits to 1e-5 (a randomly initialised
model built locally from a config and saved with ``save_pretrained``), the adapter's round
trip, padding masks, post- vs pre-LN, and pipeline stages cut from the single-process model
(CPU, seconds)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # a test dependency (requirements.txt): the independent reference
from multiproc import end_worker
from safetensors.torch import load_file

from families.roberta_hf import RobertaHFAdapter
from fp8train.precision import get_recipe
from models.context import BuildContext
from models.roberta import RobertaConfig, RobertaModel, roberta_position_ids
from parallel.pipeline.layout import PipelineLayout

V, H, LAYERS, HEADS, SEQ = 100, 32, 2, 4, 16
HF = RobertaHFAdapter()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random RobertaForMaskedLM saved as Hugging Face files (config.json + safetensors)."""
    torch.manual_seed(0)
    config = transformers.RobertaConfig(
        vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=4 * H, max_position_embeddings=SEQ + 2, type_vocab_size=1,
        layer_norm_eps=1e-5,
    )  # fmt: skip
    model = transformers.RobertaForMaskedLM(config)
    with torch.no_grad():  # non-trivial norms and biases, so a swapped tensor would show
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layer_norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf_roberta")
    model.save_pretrained(path)
    return path


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows: one full, one padded at the end with the pad id 1 (mask 0 there)."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, V, (2, SEQ), generator=gen)
    tokens[:, 0] = 0  # <s>
    tokens[1, 10:] = 1  # <pad>
    return tokens, tokens.ne(1).long()


def _ours(hf_dir, padded_vocab: int = 128, **overrides):
    hf_config = json.loads((hf_dir / "config.json").read_text())
    config = HF.config_from_hf(hf_config, padded_vocab_size=padded_vocab, **overrides)
    model = RobertaModel(config).eval()
    state = HF.state_from_hf(load_file(str(hf_dir / "model.safetensors")), config)
    missing = model.load_state_dict(state, strict=False)
    assert not missing.unexpected_keys and not missing.missing_keys, missing
    return model, config


def test_logits_match_hugging_face(hf_dir):
    hf = transformers.RobertaForMaskedLM.from_pretrained(hf_dir).eval()
    model, config = _ours(hf_dir)
    assert config.norm_position == "post" and config.activation == "gelu_exact"
    tokens, mask = _tokens()
    with torch.no_grad():
        want = hf(input_ids=tokens, attention_mask=mask).logits
        got = model(tokens, attention_mask=mask)["lm"]
    assert got.shape == (2, SEQ, 128)  # padded vocabulary
    err = (got[..., :V] - want).abs().max() / want.abs().max()
    assert err < 1e-5, err


def test_adapter_round_trip_restores_every_hugging_face_tensor(hf_dir):
    hf = load_file(str(hf_dir / "model.safetensors"))
    _, config = _ours(hf_dir)
    back = HF.state_to_hf(HF.state_from_hf(hf, config), config, V)
    expected = {k for k in hf if not k.startswith("lm_head.decoder")}
    assert set(back) == expected
    assert all(torch.equal(back[k], hf[k]) for k in expected)
    fields = HF.config_to_hf(config, V)
    assert transformers.RobertaConfig(**fields).vocab_size == V
    assert fields["max_position_embeddings"] == SEQ + 2 and fields["hidden_act"] == "gelu"


def test_sharded_directory_loads_like_the_single_file(hf_dir, tmp_path):
    """``save_pretrained`` above ``max_shard_size`` writes model.safetensors.index.json and
    shards: ``load_pretrained`` (the family's import) reads them and gives the single file's
    logits, transformers' to 1e-5; a missing shard is named."""
    from checkpoint.format import CheckpointError
    from families import load_pretrained

    hf = transformers.RobertaForMaskedLM.from_pretrained(hf_dir).eval()
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert (tmp_path / "model.safetensors.index.json").exists() and len(shards) > 1
    assert not (tmp_path / "model.safetensors").exists()
    tokens, mask = _tokens()
    with torch.no_grad():
        want = hf(input_ids=tokens, attention_mask=mask).logits
        single = load_pretrained(hf_dir)(tokens, attention_mask=mask)
        sharded = load_pretrained(tmp_path)(tokens, attention_mask=mask)
    assert torch.equal(sharded, single)
    assert (sharded[..., :V] - want).abs().max() / want.abs().max() < 1e-5
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=f"missing: {shards[-1]}"):
        load_pretrained(tmp_path)


def test_positions_skip_padding():
    tokens = torch.tensor([[0, 5, 6, 2, 1, 1]])
    assert roberta_position_ids(tokens, 1).tolist() == [[2, 3, 4, 5, 1, 1]]


def test_padding_does_not_change_real_tokens(hf_dir):
    """More padding after a sequence leaves its real tokens' logits unchanged."""
    model, _ = _ours(hf_dir)
    tokens, _ = _tokens()
    short = tokens[1:2, :10]
    longer = torch.cat([short, torch.ones(1, 6, dtype=torch.long)], dim=1)
    with torch.no_grad():
        a = model(short)["lm"]
        b = model(longer)["lm"][:, :10]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_labels_give_per_token_loss_with_ignored_positions(hf_dir):
    model, _ = _ours(hf_dir)
    tokens, mask = _tokens()
    labels = torch.full_like(tokens, -100)
    labels[:, 3] = tokens[:, 3]
    with torch.no_grad():
        logits = model(tokens, attention_mask=mask)["lm"]
        loss = model(tokens, attention_mask=mask, labels=labels)["lm"]
    want = torch.nn.functional.cross_entropy(logits[:, 3], tokens[:, 3], reduction="none")
    torch.testing.assert_close(loss[:, 3], want)
    assert torch.all(loss[:, :3] == 0)


def _small(**kw) -> RobertaConfig:
    base = dict(
        num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=128,
        norm_position="post", activation="gelu_exact", hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return RobertaConfig(**{**base, **kw})


def test_pre_and_post_norm_blocks_are_named_by_role():
    post = dict(RobertaModel(_small()).named_parameters())
    pre = dict(RobertaModel(_small(norm_position="pre")).named_parameters())
    assert "layers.0.post_mlp_norm.weight" in post and "layers.0.input_norm.weight" not in post
    assert "layers.0.input_norm.weight" in pre and "layers.0.post_mlp_norm.weight" not in pre


def test_binary_head_and_fp8_linears():
    torch.manual_seed(0)
    model = RobertaModel(
        _small(add_binary_head=True, type_vocab_size=2), BuildContext(get_recipe("te"))
    )
    tokens, mask = _tokens()
    out = model(tokens, attention_mask=mask, token_types=torch.zeros_like(tokens))
    assert out["binary"].shape == (2, 2) and out["lm"].shape == (2, SEQ, 128)
    fp8 = {name for name, m in model.linear_modules() if m.fp8}
    assert fp8 == {f"layers.{i}.{n}" for i in range(4) for n in ("attention.qkv",
        "attention.proj", "mlp.fc1", "mlp.fc2")}  # fmt: skip
    with pytest.raises(ValueError, match="two token types"):
        _small(add_binary_head=True)


@pytest.mark.parametrize("virtual", [1, 2])
def test_pipeline_stages_are_cut_from_the_single_process_model(virtual):
    torch.manual_seed(5)
    whole = RobertaModel(_small()).state_dict()
    after = torch.rand(3)
    tokens, mask = _tokens()
    for stage in range(2):
        torch.manual_seed(5)
        layout = PipelineLayout(4, 2, virtual, stage)
        part = RobertaModel(_small(), pipeline=layout)
        assert torch.equal(torch.rand(3), after)  # the RNG moved as in the whole build
        state = part.state_dict()
        assert all(torch.equal(state[k], whole[k]) for k in state)
        copies = part.pipeline_copies()
        assert copies == {"word_embeddings.weight": stage == 0}
    # Chained by hand, the stages give the whole model's loss.
    torch.manual_seed(5)
    ref = RobertaModel(_small()).eval()
    stages = []
    for stage in range(2):
        torch.manual_seed(5)
        stages.append(RobertaModel(_small(), pipeline=PipelineLayout(4, 2, virtual, stage)).eval())
    labels = tokens.clone()
    inputs = {"tokens": tokens, "attention_mask": mask, "labels": labels}
    with torch.no_grad():
        want = ref.forward_chunk(0, None, inputs)["lm"]
        hidden = None
        for chunk in range(virtual):
            for stage in range(2):
                hidden = stages[stage].forward_chunk(chunk, hidden, inputs)
    torch.testing.assert_close(hidden["lm"], want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Tensor (+ sequence) parallelism against one process, 2 gloo ranks (fp32 and te)

TP_LEVELS = {"fp32": 1e-5, "te": 0.2}  # te: each weight shard has its own FP8 scales


def _tp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist
    from multiproc import tensor_parallel_errors

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    tokens, mask = _tokens()
    labels = torch.where(torch.rand(tokens.shape, generator=torch.Generator().manual_seed(2))
                         < 0.3, tokens, torch.full_like(tokens, -100))  # fmt: skip
    counted = labels.ne(-100).float()
    config = _small(add_binary_head=True, type_vocab_size=2)

    def loss_of(model):
        out = model(tokens, attention_mask=mask, labels=labels)
        return (out["lm"] * counted).sum() / counted.sum() + out["binary"].square().mean()

    results = tensor_parallel_errors(TP_LEVELS, lambda ctx: RobertaModel(config, ctx), loss_of)
    if rank == 0:
        Path(out_dir, "results.json").write_text(json.dumps(results))
    end_worker()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("roberta_tp")
    mp.start_processes(
        _tp_worker, args=(2, str(out / "init"), str(out)), nprocs=2, start_method="fork"
    )  # forked: inherits the imports
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("layout", ["tp", "tp_sp"])
@pytest.mark.parametrize("level", list(TP_LEVELS))
def test_tensor_parallel_loss_and_every_gradient_match_one_process(tp_results, level, layout):
    """MLM loss over masked tokens plus the binary head, backward, every gradient gathered
    under the single-process names: the padding mask, the vocab-parallel head and bias, and
    the sequence gather before the replicated heads all match one process."""
    r = tp_results[f"{level}/{layout}"]
    assert r["names"]
    assert r["loss"] < (1e-6 if level == "fp32" else 1e-3), r
    assert r["grads"][0] < TP_LEVELS[level], r  # [worst relative error, its tensor]


def test_exported_model_gives_the_same_logits_in_transformers(tmp_path):
    """A model of this project (random init, post-LN, exact GELU, padded vocabulary) saved as
    Hugging Face files loads in transformers and gives the same logits on a padded batch."""
    torch.manual_seed(11)
    config = _small(num_layers=2, max_position_embeddings=SEQ + 2, padding_idx=1)
    ours = RobertaModel(config).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in ours.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    HF.save(tmp_path, dict(ours.named_parameters()), config, vocab_size=V)
    hf = transformers.RobertaForMaskedLM.from_pretrained(tmp_path).eval()
    tokens, mask = _tokens()
    with torch.no_grad():
        want = ours(tokens, attention_mask=mask)["lm"][..., :V]
        got = hf(input_ids=tokens, attention_mask=mask).logits
    assert (got - want).abs().max() <= 1e-4
    # ... and back: the reloaded parameters are the exported ones (the vocabulary re-padded).
    config_back, state = HF.load(tmp_path, padded_vocab_size=128)
    assert config_back == config
    params = dict(ours.named_parameters())
    assert all(torch.equal(state[k], params[k].detach()) for k in state if k not in (
        "word_embeddings.weight", "lm_bias.bias"))  # fmt: skip
    assert torch.equal(state["word_embeddings.weight"][:V], params["word_embeddings.weight"][:V])


def test_masked_lm_loss_and_every_gradient_match_hugging_face(tmp_path):
    """Training, not only inference, follows transformers: the MLM loss over chosen positions
    and every parameter's gradient (Q/K/V split back per head) equal RobertaForMaskedLM's
    (same weights, no dropout, unpadded vocabulary so both softmaxes cover the same ids)."""
    torch.manual_seed(0)
    config = transformers.RobertaConfig(
        vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=4 * H, max_position_embeddings=SEQ + 2, type_vocab_size=1,
        layer_norm_eps=1e-5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    hf = transformers.RobertaForMaskedLM(config)
    hf.save_pretrained(tmp_path)
    ours, ours_config = _ours(tmp_path, padded_vocab=V)
    ours.train()
    hf.train()
    tokens, mask = _tokens()
    labels = torch.full_like(tokens, -100)
    labels[:, 2:6] = tokens[:, 2:6]
    loss = ours(tokens, attention_mask=mask, labels=labels)["lm"][labels.ne(-100)].mean()
    loss.backward()
    want = hf(input_ids=tokens, attention_mask=mask, labels=labels).loss
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-6 * want.item()
    grads = HF.state_from_hf({n: p.grad for n, p in hf.named_parameters()}, ours_config)
    params = dict(ours.named_parameters())
    assert set(grads) == set(params)
    for name, g in grads.items():
        err = (params[name].grad - g).norm() / g.norm().clamp(min=1e-12)
        assert err < 1e-5, (name, err.item())


def test_bf16_small_tables_sum_their_gradient_in_fp32():
    # A BF16 table's own CPU backward adds the looked-up rows' gradients in BF16, and the
    # one token-type row sums every token's: bf16 RoBERTa trained worse than fp32 because of
    # it (docs/BENCHMARKS.md). The lookup sums in FP32 and rounds to BF16 once, so the row's
    # gradient is the float64 sum to one BF16 rounding (2**-8 relative, BF16's unit roundoff) plus
    # FP32's accumulation error over 1024 terms (far below that).
    from models.roberta import _fp32_grad_lookup

    table = torch.nn.Embedding(1, 64).to(torch.bfloat16)
    ids = torch.zeros(8, 128, dtype=torch.long)
    upstream = torch.randn(8, 128, 64, generator=torch.Generator().manual_seed(3))
    out = _fp32_grad_lookup(table, ids)
    assert out.dtype == torch.bfloat16 and torch.equal(out[0, 0], table.weight[0])
    terms = upstream.to(torch.bfloat16)
    out.backward(terms)
    exact = terms.double().sum(dim=(0, 1))
    err = (table.weight.grad[0].double() - exact).abs()
    fp32_sum = 1024 * 2.0**-24 * terms.double().abs().sum(dim=(0, 1))  # worst case, n terms
    assert torch.all(err <= 2.0**-8 * (exact.abs() + fp32_sum) + fp32_sum)
