"""KV-cache decoding (models/kv_cache.py, ``GPTModel.forward(..., kv_cache=)``) and
tools/generate.py: cached logits equal full forwards, greedy and seeded sampling, padded
vocabulary never sampled, the training forward untouched, the command line end to end.
Tiny real models on CPU, seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from data.corpus import stdlib_documents
from data.tokenizer import SentencePieceTokenizer, train_sentencepiece
from families.gpt_hf import GPTHFAdapter
from fp8train.gemm_backend import set_gemm_backend
from fp8train.precision import get_recipe
from models.context import BuildContext
from models.gpt import GPTConfig, GPTModel
from parallel.pipeline.layout import PipelineLayout
from tools.generate import filter_logits, generate, main

PADDED, TRUE_V, S = 128, 100, 32
TOL = 1e-5  # fp32: cached and full forwards differ only in summation order


def gpt2(**kw) -> GPTConfig:
    base = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=S, vocab_size=PADDED
    )
    return GPTConfig(**{**base, **kw})


def llama(**kw) -> GPTConfig:
    style = dict(
        position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
        add_bias_linear=False, untie_embeddings_and_output_weights=True,
        num_query_groups=2, rotary_base=500.0,
    )  # fmt: skip
    return gpt2(**{**style, **kw})


STYLES = {"gpt2": gpt2, "llama": llama}


def build(style: str, level: str = "fp32", seed: int = 0, **kw) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(STYLES[style](**kw), BuildContext(get_recipe(level))).eval()


def tokens(b: int = 2, s: int = S, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TRUE_V, (b, s), generator=torch.Generator().manual_seed(seed))


def cached_logits(model: GPTModel, t: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """``t`` fed through one cache in pieces of ``chunks`` tokens; logits of every position."""
    cache = model.new_kv_cache()
    out, start = [], 0
    for n in chunks:
        out.append(model(t[:, start : start + n], kv_cache=cache))
        start += n
    assert start == t.shape[1] and cache.length == start
    return torch.cat(out, dim=1)


@pytest.fixture
def emulated_fp8():
    set_gemm_backend("emulated")  # pinned: the auto choice may differ between runs
    yield
    set_gemm_backend(None)


# A prompt of 7, then one token at a time (decoding), a chunk of 5 with 15 cached (the causal
# mask offset by the prefix), then single tokens again to the end.
CHUNKS = [7] + [1] * 8 + [5] + [1] * 12


@pytest.mark.parametrize("style", list(STYLES))
def test_cached_logits_equal_full_forward(style):
    model = build(style)
    if style == "llama":
        cfg = model.config
        assert cfg.num_query_groups < cfg.num_attention_heads  # grouped-query attention
    t = tokens()
    with torch.no_grad():
        full = model(t)
    inc = cached_logits(model, t, CHUNKS)
    diff = (inc - full).abs().max().item()
    print(f"\n{style} fp32: max |cached - full| logit = {diff:.2e}")
    assert inc.shape == full.shape and diff <= TOL, diff
    # The cache holds one k/v head per query group, not per query head.
    cache = model.new_kv_cache()
    model(t[:, :3], kv_cache=cache)
    keys = cache.layers[0].keys
    assert keys.shape == (2, model.config.num_query_groups, S, model.config.kv_channels)


@pytest.mark.parametrize("style", list(STYLES))
def test_fp8_te_cache_matches_and_leaves_scaling_state(style, emulated_fp8):
    model = build(style, "te")
    t = tokens()
    # One training step fills the delayed-scaling history: eval casts then use its scales.
    model.train()
    model(t, labels=t).mean().backward()
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        full = model(t)
    inc = cached_logits(model, t, CHUNKS)
    diff = (inc - full).abs().max().item()
    print(f"\n{style} te: max |cached - full| logit = {diff:.2e}")
    # Typically ~1e-7; a last-bit difference may flip one E4M3 rounding (a 6% step of one
    # element), which moves logits by ~1e-3, so the bound leaves room for that.
    assert diff <= 1e-2, diff
    assert any(m.fp8 for _, m in model.linear_modules())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "eval changed FP8 state"


@pytest.mark.parametrize("style", list(STYLES))
def test_greedy_same_tokens_with_and_without_cache(style):
    model = build(style)
    prompt = tokens(1, 5)[0].tolist()
    with_cache = generate(model, prompt, 20, greedy=True, use_cache=True)
    without = generate(model, prompt, 20, greedy=True, use_cache=False)
    assert with_cache == without and len(with_cache) == 20
    # The whole context: the prompt plus 28 new tokens uses exactly S positions.
    assert len(generate(model, prompt, S - 5 + 1, greedy=True)) == S - 5 + 1
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(model, prompt, S - 5 + 2, greedy=True)


def test_top_k_1_is_greedy_and_eos_stops():
    model = build("llama")
    prompt = tokens(1, 4)[0].tolist()
    greedy = generate(model, prompt, 16, greedy=True, true_vocab=TRUE_V)
    g = torch.Generator().manual_seed(3)
    top1 = generate(model, prompt, 16, temperature=0.7, top_k=1, generator=g, true_vocab=TRUE_V)
    assert top1 == greedy
    eos = greedy[5]
    stopped = generate(model, prompt, 16, greedy=True, eos_id=eos, true_vocab=TRUE_V)
    assert stopped == greedy[: greedy.index(eos) + 1]


@pytest.mark.parametrize("style", list(STYLES))
def test_sampling_reproducible_and_never_padded(style):
    model = build(style)
    prompt = tokens(1, 3)[0].tolist()

    def sample(seed, true_vocab=TRUE_V, use_cache=True, **kw):
        g = torch.Generator().manual_seed(seed)
        return generate(
            model, prompt, 28, generator=g, true_vocab=true_vocab, use_cache=use_cache, **kw
        )

    for kw in (dict(temperature=3.0), dict(temperature=0.8, top_p=0.9), dict(top_k=20)):
        a, b = sample(5, **kw), sample(5, **kw)
        assert a == b, kw
        assert a == sample(5, use_cache=False, **kw), kw
        assert a != sample(6, **kw), kw
        assert max(a) < TRUE_V, kw
    # The check can fail: at a high temperature the padded rows (28 of 128 ids) do get drawn
    # when they are not masked.
    hot = sample(5, true_vocab=None, temperature=3.0)
    assert max(hot) >= TRUE_V


def test_filter_logits_top_k_and_top_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    kept = lambda out: torch.isfinite(out).nonzero().flatten().tolist()
    assert kept(filter_logits(logits, top_k=2)) == [0, 1]
    assert kept(filter_logits(logits, top_p=0.8)) == [0, 1]
    assert kept(filter_logits(logits, top_p=0.81)) == [0, 1, 2]
    assert kept(filter_logits(logits, top_p=0.1)) == [0]  # the most probable always stays
    assert kept(filter_logits(logits[[2, 0, 3, 1]], top_p=0.8)) == [1, 3]  # any order
    assert kept(filter_logits(logits, top_k=3, top_p=0.95)) == [0, 1, 2]


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_training_forward_unchanged_by_cache_use(recompute):
    """The training path (no cache) gives the same loss and gradients, bit for bit, whether or
    not the model decoded with a cache in between; decoding leaves no state behind."""

    def train_step(model):
        torch.manual_seed(7)  # dropout masks
        t = tokens()
        model.train()
        loss = model(t, labels=t).mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        return loss.detach(), grads

    kw = dict(hidden_dropout=0.1, attention_dropout=0.1, recompute=recompute)
    fresh, used = build("llama", "te", **kw), build("llama", "te", **kw)
    used.eval()
    cached_logits(used, tokens(s=6), [4, 1, 1])
    generate(used, [1, 2, 3], 4, greedy=True)
    for a, b in zip(fresh.state_dict().values(), used.state_dict().values()):
        assert torch.equal(a, b)
    loss_a, grads_a = train_step(fresh)
    loss_b, grads_b = train_step(used)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def test_cache_refuses_misuse():
    model = build("gpt2")
    with pytest.raises(ValueError, match="eval mode"):
        model.train().new_kv_cache()
    model.eval()
    with pytest.raises(ValueError, match="max_length"):
        model.new_kv_cache(S + 1)
    cache = model.new_kv_cache(4)
    model(tokens(1, 3), kv_cache=cache)
    with pytest.raises(ValueError, match="KV cache full"):
        model(tokens(1, 2), kv_cache=cache)
    assert cache.length == 3  # the refused call appended nothing
    with pytest.raises(ValueError, match=r"\[batch, groups, head_dim\]"):
        model(tokens(2, 1), kv_cache=cache)
    with pytest.raises(ValueError, match="layers"):
        build("gpt2", num_layers=1)(tokens(1, 1), kv_cache=cache)
    stage = GPTModel(gpt2(), None, PipelineLayout(2, 2, 1, 0)).eval()
    with pytest.raises(ValueError, match="single-process"):
        stage.new_kv_cache()


# ---- the command line ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    """A 400-piece SentencePiece model trained on a few stdlib sources (about a second)."""
    docs = stdlib_documents()[:5]
    return train_sentencepiece(docs, tmp_path_factory.mktemp("tok") / "tok", 400)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, spm_model) -> Path:
    """A tiny Llama-style model with the tokenizer's vocabulary, padded to 512 rows."""
    vocab = SentencePieceTokenizer(spm_model).vocab_size
    torch.manual_seed(0)
    config = llama(vocab_size=512)
    model = GPTModel(config)
    out = tmp_path_factory.mktemp("hf")
    params = {k: v.detach() for k, v in model.named_parameters()}
    GPTHFAdapter().save(out, params, config, vocab_size=vocab)
    return out


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_generates_same_text_with_and_without_cache(capsys, hf_dir, spm_model):
    base = ["--checkpoint", hf_dir, "--tokenizer", spm_model, "--prompt", "def "]
    code, out, err = run_cli(capsys, *base, "--greedy", "--max-new-tokens", 12)
    assert code == 0, err
    assert out.startswith("def ") and len(out) > len("def \n")
    assert "KV cache" in err
    code, out_nc, err = run_cli(capsys, *base, "--greedy", "--max-new-tokens", 12, "--no-cache")
    assert code == 0 and out_nc == out and "no cache" in err
    sampled = [
        run_cli(capsys, *base, "--temperature", 0.9, "--top-p", 0.95, "--seed", 4)[1]
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_cli_native_checkpoint_uses_its_tokenizer(capsys, tmp_path, hf_dir, spm_model):
    from training.conversion import Layout, import_hf

    ckpt = import_hf(hf_dir, tmp_path / "native", Layout(), progress=lambda _line: None)
    args = ["--prompt", "import ", "--greedy", "--max-new-tokens", 8]
    # An import holds weights only: its placeholder data section is not the model's tokenizer.
    code, _, err = run_cli(capsys, "--checkpoint", tmp_path / "native", *args)
    assert code == 2 and "weights only" in err and "--tokenizer" in err
    # Make it a run's checkpoint, trained on a prefix corpus with this tokenizer.
    meta_path = Path(ckpt) / "metadata.json"
    meta = json.loads(meta_path.read_text())
    del meta["weights_only"]
    meta["config"]["data"].update(
        corpus="prefix", tokenizer_model=str(spm_model), tokenizer_type="sentencepiece"
    )
    meta_path.write_text(json.dumps(meta))
    code, out, err = run_cli(capsys, "--checkpoint", tmp_path / "native", *args)
    assert code == 0, err
    want = run_cli(capsys, "--checkpoint", hf_dir, "--tokenizer", spm_model, *args)[1]
    assert out == want
    # A tokenizer whose vocabulary is not the one the model was trained with is refused.
    meta["model_structure"]["vocab_size"] += 1
    meta_path.write_text(json.dumps(meta))
    code, _, err = run_cli(capsys, "--checkpoint", tmp_path / "native", *args)
    assert code == 2 and "trained with" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "args, culprit",
    [
        (["--checkpoint", "{missing}", "--prompt", "x"], "{missing}"),
        (["--checkpoint", "{hf}", "--prompt", "x", "--greedy", "--top-k", "5"], "--top-k"),
        (["--checkpoint", "{hf}", "--prompt", "x", "--temperature", "0"], "--temperature"),
        (["--checkpoint", "{hf}", "--prompt", "x", "--top-p", "1.5"], "--top-p"),
        (["--checkpoint", "{hf}", "--prompt", "x", "--bogus"], "--bogus"),
        (["--prompt", "x"], "--checkpoint"),
        (["--checkpoint", "{hf}", "--prompt", "x"], "tokenizer"),  # HF dir without one
        (["--checkpoint", "{hf}", "--prompt", "x", "--tokenizer", "{missing}"], "{missing}"),
    ],
)
def test_cli_errors_are_one_line(capsys, tmp_path, hf_dir, args, culprit):
    names = {"missing": tmp_path / "nope", "hf": hf_dir}
    code, out, err = run_cli(capsys, *(a.format(**names) for a in args))
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert culprit.format(**names) in err
