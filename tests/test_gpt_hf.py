"""GPT family <-> Hugging Face ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` (families/gpt_hf.py's
``GPTHFAdapter``):
logits and training gradients equal transformers' at fp32, bitwise round trips of every
on-disk tensor, export of this project's models, and one clear error per unsupported setting.

Every Hugging Face model is random and built locally from a config (``save_pretrained`` to a
temporary directory, nothing downloaded); the vocabulary (1000) is not a multiple of 128, so
the padding on import and the cut on export are exercised. CPU, seconds.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
import transformers  # a test dependency (requirements.txt): the independent reference
from safetensors.torch import load_file

from families.gpt import GPTFamily, GPTModelSection
from families.gpt_hf import GPTHFAdapter
from fp8train.precision import get_recipe
from models.context import BuildContext
from models.gpt import GPTConfig, GPTModel

V, PADDED, H, LAYERS, HEADS, KV, SEQ, POSITIONS = 1000, 1024, 32, 2, 4, 2, 16, 32
LOGIT_TOL = 1e-4
HF = GPTHFAdapter()

# Hugging Face variants: GPT-2 tied and untied; Llama with GQA (4 query heads, 2 kv heads)
# untied, tied, and with biases on all its GEMMs (attention_bias = mlp_bias = true).
HF_VARIANTS = {
    "gpt2": ("gpt2", {}),
    "gpt2_untied": ("gpt2", {"tie_word_embeddings": False}),
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama_bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
}


def _hf_config(kind: str, **kw):
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=V, n_embd=H, n_layer=LAYERS, n_head=HEADS, n_positions=POSITIONS,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
            bos_token_id=None, eos_token_id=None, **kw,
        )  # fmt: skip
    base = dict(
        vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV, intermediate_size=48, max_position_embeddings=POSITIONS,
        rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return transformers.LlamaConfig(**{**base, **kw})


def _perturb(named_parameters) -> None:
    """Non-trivial norms and biases, so a swapped or dropped tensor would show."""
    with torch.no_grad():
        for name, p in named_parameters:
            if any(s in name for s in ("ln_", "norm", "layernorm")) or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))


@pytest.fixture(scope="module", params=list(HF_VARIANTS))
def hf_dir(request, tmp_path_factory):
    """A random Hugging Face causal LM saved as config.json + model.safetensors."""
    kind, kw = HF_VARIANTS[request.param]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(kind, **kw))
    _perturb(model.named_parameters())
    path = tmp_path_factory.mktemp(f"hf_{request.param}")
    model.save_pretrained(path)
    return path


def _tokens() -> torch.Tensor:
    return torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _hf_config_dict(path) -> dict:
    return json.loads((path / "config.json").read_text())


def _ours(path, padded_vocab: int | None = None) -> tuple[GPTModel, GPTConfig]:
    config, state = HF.load(path, padded_vocab_size=padded_vocab)
    model = GPTModel(config).eval()
    result = model.load_state_dict(state, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    return model, config


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_imported_logits_match_transformers(hf_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    model, config = _ours(hf_dir)
    assert config.vocab_size == PADDED and config.seq_length == POSITIONS
    tokens = _tokens()
    with torch.no_grad():
        want = hf(input_ids=tokens).logits
        got = model(tokens)
    assert got.shape == (2, SEQ, PADDED)
    diff = _max_diff(got[..., :V], want)
    print(f"\n{hf_dir.name}: max |logit diff| = {diff:.2e}")
    assert diff <= LOGIT_TOL, diff


def test_round_trip_restores_every_on_disk_tensor_and_the_config(hf_dir):
    on_disk = load_file(str(hf_dir / "model.safetensors"))
    original = _hf_config_dict(hf_dir)
    config = HF.config_from_hf(original)
    back = HF.state_to_hf(HF.state_from_hf(on_disk, config), config, V)
    assert set(back) == set(on_disk)
    unequal = [k for k in on_disk if not torch.equal(back[k], on_disk[k])]
    assert not unequal, unequal
    fields = HF.config_to_hf(config, V)
    assert HF.config_from_hf(fields) == config
    if original["model_type"] == "gpt2":
        same = ["vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "activation_function",
                "layer_norm_epsilon", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                "initializer_range", "scale_attn_weights", "tie_word_embeddings"]  # fmt: skip
        assert fields["n_inner"] == (original["n_inner"] or 4 * H)
    else:
        same = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                "max_position_embeddings", "rms_norm_eps", "rope_parameters", "attention_bias",
                "mlp_bias", "attention_dropout", "initializer_range", "tie_word_embeddings",
                "architectures", "model_type"]  # fmt: skip
    assert {k: fields[k] for k in same} == {k: original[k] for k in same}


# This project's models in each exportable style (random init, perturbed norms and biases).
OUR_STYLES = {
    "gpt2": dict(activation="gelu"),
    "gpt2_exact_gelu_untied": dict(
        activation="gelu_exact", untie_embeddings_and_output_weights=True
    ),
    "llama": dict(
        position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
        add_bias_linear=False, num_query_groups=KV, ffn_hidden_size=48, rotary_base=500.0,
        untie_embeddings_and_output_weights=True,
    ),
    "llama_tied_wide_heads": dict(
        position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
        add_bias_linear=False, num_query_groups=KV, kv_channels=16,
    ),
}  # fmt: skip


def _our_config(style: str, **kw) -> GPTConfig:
    base = dict(
        num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, seq_length=SEQ,
        vocab_size=PADDED, norm_epsilon=1e-5,
    )  # fmt: skip
    return GPTConfig(**{**base, **OUR_STYLES[style], **kw})


@pytest.mark.parametrize("style", list(OUR_STYLES))
def test_exported_model_gives_the_same_logits_in_transformers(style, tmp_path):
    torch.manual_seed(11)
    config = _our_config(style)
    ours = GPTModel(config).eval()
    _perturb(ours.named_parameters())
    params = {k: v.detach() for k, v in ours.named_parameters()}
    HF.save(tmp_path, params, config, vocab_size=V)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == ("GPT2LMHeadModel" if HF.hf_style(config) == "gpt2"
                                 else "LlamaForCausalLM")  # fmt: skip
    tokens = _tokens()
    with torch.no_grad():
        want = ours(tokens)[..., :V]
        got = hf(input_ids=tokens).logits
    diff = _max_diff(got, want)
    print(f"\nexport {style}: max |logit diff| = {diff:.2e}")
    assert diff <= LOGIT_TOL, diff
    # ... and back: the same config and parameters (the vocabulary re-padded with zeros).
    config_back, state = HF.load(tmp_path, padded_vocab_size=PADDED, seq_length=SEQ)
    assert config_back == config
    assert set(state) == set(params)
    for name, value in state.items():
        if name in ("word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(value[:V], params[name][:V]) and not value[V:].any()
        else:
            assert torch.equal(value, params[name]), name


@pytest.mark.parametrize("variant", ["llama", "llama_tied", "llama_bias", "gpt2"])
def test_causal_lm_loss_and_every_gradient_match_transformers(variant, tmp_path):
    """Training follows transformers too: the next-token loss and every parameter's gradient
    (Q/K/V and gate/up mapped back through the adapter) equal the Hugging Face model's
    (same weights, no dropout, unpadded vocabulary so both softmaxes cover the same ids)."""
    kind, kw = HF_VARIANTS[variant]
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(kind, **kw))
    _perturb(hf.named_parameters())
    hf.save_pretrained(tmp_path)
    ours, config = _ours(tmp_path, padded_vocab=V)
    ours.train()
    hf.train()
    tokens = _tokens()
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], 1)  # next token
    loss = ours(tokens, labels=labels)[labels.ne(-100)].mean()
    loss.backward()
    want = hf(input_ids=tokens, labels=tokens).loss  # transformers shifts the labels itself
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-6 * want.item()
    grads = HF.state_from_hf({n: p.grad for n, p in hf.named_parameters()}, config)
    params = dict(ours.named_parameters())
    assert set(grads) == set(params)
    worst = 0.0
    for name, g in grads.items():
        err = ((params[name].grad - g).norm() / g.norm().clamp(min=1e-12)).item()
        worst = max(worst, err)
        assert err < 1e-5, (name, err)
    print(f"\n{variant}: |loss diff| = {abs(loss.item() - want.item()):.1e}, "
          f"worst relative gradient error = {worst:.1e}")  # fmt: skip


def test_export_of_a_training_checkpoint(tmp_path):
    """A canonical (format-2) checkpoint of the GPT family with FP8 scaling state (level te),
    as training writes it: the export leaves the FP8 state out and transformers gives the
    logits of this project's model with those weights. A checkpoint of another family, or one
    whose format check fails, is refused naming the reason (metadata.json, the missing file)."""
    from checkpoint.format import FORMAT_VERSION, CheckpointError, write_tensors

    style = OUR_STYLES["llama"]
    section = GPTModelSection(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS,
                              seq_length=SEQ, norm_epsilon=1e-5, **style)  # fmt: skip
    config = section.resolved(vocab_size=PADDED)
    torch.manual_seed(5)
    trained = GPTModel(config, BuildContext(get_recipe("te")))
    _perturb(trained.named_parameters())
    state = trained.state_dict()
    assert any(".fp8_" in k for k in state)
    checkpoint = tmp_path / "iter_0000010"
    checkpoint.mkdir()
    write_tensors(checkpoint / "model.safetensors", state, {})
    structure = GPTFamily().checkpoint_structure(config)
    meta = {
        "family": "gpt", "world_size": 1, "model_structure": {**structure, "vocab_size": V},
        "config": {"model": dataclasses.asdict(section), "parallel": {"tensor": 1, "pipeline": 1}},
        "format_version": FORMAT_VERSION,
    }  # fmt: skip
    (checkpoint / "metadata.json").write_text(json.dumps(meta))
    out = HF.export(checkpoint, tmp_path / "hf")
    assert set(load_file(str(out / "model.safetensors"))) == set(
        HF.state_to_hf(dict(trained.named_parameters()), config, V)
    )
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    ours = GPTModel(config).eval()  # fp32: the reference for the exported FP32 weights
    ours.load_state_dict({k: v for k, v in state.items() if ".fp8_" not in k})
    tokens = _tokens()
    with torch.no_grad():
        diff = _max_diff(hf(input_ids=tokens).logits, ours(tokens)[..., :V])
    assert diff <= LOGIT_TOL, diff
    meta["model_structure"]["family"] = "roberta"
    (checkpoint / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not gpt"):
        HF.export(checkpoint, tmp_path / "hf2")
    # The format check: another format version, then a slice's file missing (TP=2 of which
    # only the first file is there: the canonical reader alone would not name the other).
    meta["model_structure"]["family"] = "gpt"
    (checkpoint / "metadata.json").write_text(json.dumps({**meta, "format_version": 1}))
    with pytest.raises(
        CheckpointError,
        match=re.escape(f"{checkpoint / 'metadata.json'}: checkpoint format version 1;"),
    ):
        HF.export(checkpoint, tmp_path / "hf3")
    meta["config"]["parallel"]["tensor"] = 2
    meta["world_size"] = 2
    (checkpoint / "model.safetensors").rename(checkpoint / "model_tp0.safetensors")
    (checkpoint / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(
        CheckpointError, match=re.escape(f"missing: {checkpoint / 'model_tp1.safetensors'}")
    ):
        HF.export(checkpoint, tmp_path / "hf4")
    assert not any((tmp_path / name).exists() for name in ("hf2", "hf3", "hf4"))


def _llama_dict(**kw) -> dict:
    return _hf_config("llama", **kw).to_dict()


@pytest.mark.parametrize(
    ("hf", "key"),
    [
        (lambda: _llama_dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
         "rope_parameters.rope_type"),
        (lambda: {**_llama_dict(), "rope_parameters": None, "rope_theta": 1e4,
                  "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type"),
        (lambda: _llama_dict(attention_bias=True), "attention_bias"),
        (lambda: _llama_dict(mlp_bias=True), "mlp_bias"),
        (lambda: _llama_dict(hidden_act="gelu"), "hidden_act"),
        (lambda: _hf_config("gpt2", activation_function="relu").to_dict(), "activation_function"),
        (lambda: _hf_config("gpt2", scale_attn_by_inverse_layer_idx=True).to_dict(),
         "scale_attn_by_inverse_layer_idx"),
        (lambda: {**_llama_dict(), "model_type": "mistral"}, "model_type"),
    ],
)  # fmt: skip
def test_unsupported_config_is_one_value_error_naming_the_key(hf, key):
    with pytest.raises(ValueError, match=f"config.json {key}="):
        HF.config_from_hf(hf())


def test_old_style_rope_theta_and_unscaled_rope_scaling_are_read():
    hf = {**_llama_dict(), "rope_parameters": None, "rope_theta": 2.5e5, "rope_scaling": None}
    assert HF.config_from_hf(hf).rotary_base == 2.5e5
    hf["rope_scaling"] = {"type": "default"}
    assert HF.config_from_hf(hf).rotary_base == 2.5e5
    assert HF.config_from_hf(_llama_dict(), seq_length=8).seq_length == 8


def test_architectures_without_a_hugging_face_class_are_refused():
    for kw, needle in [
        (dict(norm_position="post"), "norm_position"),
        (dict(position_embedding_type="rope"), "no Hugging Face class"),
        (dict(add_bias_linear=False), "add_bias_linear"),
        (dict(num_query_groups=2), "num_query_groups"),
    ]:
        with pytest.raises(ValueError, match=needle):
            HF.config_to_hf(_our_config("gpt2", **kw), V)


def test_buffers_and_bare_model_keys_are_read_and_unknown_keys_raise(tmp_path):
    """GPT-2 files saved by older transformers carry the causal-mask buffers, and the bare
    ``GPT2Model``'s keys have no ``transformer.`` prefix; both read as the usual file."""
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(_hf_config("gpt2"))
    on_disk = {k: v.detach() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    config = HF.config_from_hf(hf.config.to_dict())
    want = HF.state_from_hf(on_disk, config)
    legacy = {k.removeprefix("transformer."): v for k, v in on_disk.items()}
    legacy["h.0.attn.bias"] = torch.ones(1, 1, POSITIONS, POSITIONS).tril()
    legacy["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    got = HF.state_from_hf(legacy, config)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(KeyError, match="transformer.h.0.attn.c_attn.lora_A"):
        HF.state_from_hf({**on_disk, "transformer.h.0.attn.c_attn.lora_A": torch.zeros(1)}, config)
    llama = HF.config_from_hf(_llama_dict())
    with pytest.raises(KeyError, match="q, k or v"):
        HF.state_from_hf({"model.layers.0.self_attn.q_proj.weight": torch.zeros(H, H)}, llama)
    for key in ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.input_layernorm.bias"):
        with pytest.raises(KeyError, match=key):  # no biases in this Llama, none on its norms
            HF.state_from_hf({key: torch.zeros(H)}, llama)


def test_fp8_state_is_left_out_of_the_export():
    config = _our_config("llama")
    fp32 = HF.state_to_hf(GPTModel(config).state_dict(), config, V)
    te = HF.state_to_hf(GPTModel(config, BuildContext(get_recipe("te"))).state_dict(), config, V)
    assert set(te) == set(fp32)
    with pytest.raises(KeyError, match="position_embeddings"):
        HF.state_to_hf({"position_embeddings.weight": torch.zeros(SEQ, H)}, config, V)


def test_grouped_qkv_layout_is_the_models():
    """The fused rows are ``[G x (r q-heads, k head, v head) x d]`` (models/transformer.py),
    and split inverts fuse exactly."""
    d, groups, r = 3, 2, 2
    q = torch.arange(groups * r * d).float()[:, None] + 100
    k = torch.arange(groups * d).float()[:, None] + 200
    v = torch.arange(groups * d).float()[:, None] + 300
    fused = HF.fuse_qkv(q, k, v, groups)
    by_head = fused.view(groups, r + 2, d)
    assert torch.equal(by_head[1, 0], q[6:9, 0]) and torch.equal(by_head[1, 1], q[9:12, 0])
    assert torch.equal(by_head[1, 2], k[3:6, 0]) and torch.equal(by_head[1, 3], v[3:6, 0])
    assert all(torch.equal(a, b) for a, b in zip(HF.split_qkv(fused, groups, r), (q, k, v)))


def test_per_head_qkv_is_the_grouped_layout_with_one_head_per_group():
    """Multi-head attention (RoBERTa, ViT, GPT-2): groups = heads gives the per-head rows
    ``[q_0, k_0, v_0, q_1, ...]`` (each d rows), for weights and biases, and splits back."""
    d, heads, width = 3, 4, 5
    for rest in ((), (width,)):
        q, k, v = (torch.randn(heads * d, *rest) for _ in range(3))
        fused = HF.fuse_qkv(q, k, v, heads)
        want = torch.stack([t.reshape(heads, d, *rest) for t in (q, k, v)], 1)
        assert torch.equal(fused, want.reshape(3 * heads * d, *rest))
        assert all(torch.equal(a, b) for a, b in zip(HF.split_qkv(fused, heads), (q, k, v)))


# ---------------------------------------------------------------------------------------------
# A trained checkpoint through tools/export_hf.py (GPT-2 and Llama styles, TP=2 shards)


def _train_worker(rank: int, world: int, port: int, configs: list[tuple[str, list[str]]]) -> None:
    from multiproc import rank_env

    rank_env(rank, world, port)
    torch.set_num_threads(1)
    from parallel.topology import destroy_distributed
    from training.config import load_config
    from training.loop import pretrain

    for config, overrides in configs:
        pretrain(load_config(config, overrides))
    destroy_distributed()


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """3 steps of a GPT-2 style and a Llama style model at TP=2 (fp32), each checkpointed."""
    from conftest import REPO, tiny_overrides
    from multiproc import run_ranks

    import training.loop  # noqa: F401  (imported once here, inherited by the forked ranks)

    root = tmp_path_factory.mktemp("gpt_export")
    runs = {}
    for style in ("gpt", "llama"):
        run_dir = root / style
        extra = {"training.train_iters": 3, "checkpoint.save_interval": 3,
                 "parallel.tensor": 2, "model.hidden_dropout": 0.0,
                 "model.attention_dropout": 0.0}  # fmt: skip
        overrides = tiny_overrides(tiny_data, run_dir, "fp32", **extra)
        runs[style] = (str(REPO / f"configs/{style}_tiny.yaml"), overrides, run_dir)
    configs = [(config, overrides) for config, overrides, _ in runs.values()]
    run_ranks(_train_worker, 2, (configs,), timeout=300, start_method="fork")
    return {style: run_dir for style, (_, _, run_dir) in runs.items()}


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_exported_training_checkpoint_gives_the_same_logits_in_transformers(
    trained, style, tmp_path
):
    from checkpoint.format import reassemble
    from families.gpt import GPTModelSection
    from models.gpt import GPTModel
    from tools.export_hf import main as export_main

    # The tool's main in this process (the script as a process: tests/test_vit_training.py).
    checkpoint = trained[style] / "checkpoints" / "iter_0000003"
    assert export_main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "hf")]) == 0
    cls = transformers.LlamaForCausalLM if style == "llama" else transformers.GPT2LMHeadModel
    hf = cls.from_pretrained(tmp_path / "hf").eval()
    meta = json.loads((checkpoint / "metadata.json").read_text())
    s = meta["model_structure"]
    assert hf.config.eos_token_id == s["token_ids"]["eos_token_id"]
    config = GPTModelSection(**meta["config"]["model"]).resolved(vocab_size=s["padded_vocab_size"])
    ours = GPTModel(config).eval()
    result = ours.load_state_dict(reassemble(checkpoint, "model"), strict=False)
    assert not result.missing_keys, result
    tokens = torch.randint(0, s["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(tokens)[..., : s["vocab_size"]]
        got = hf(input_ids=tokens).logits
    assert (got - want).abs().max() <= 1e-4
