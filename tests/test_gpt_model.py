"""GPT model: shapes, causality, loss, switches, FP8 wiring, and a quick overfit (CPU, seconds)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp8train.linear import Linear
from fp8train.precision import get_recipe
from models.context import BuildContext
from models.gpt import GPTConfig, GPTModel, pad_vocab_size
from models.transformer import MLP, RMSNorm, SelfAttention

V, S = 96, 16


def tiny(**overrides) -> GPTConfig:
    kw = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=S,
        vocab_size=V,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kw.update(overrides)
    return GPTConfig(**kw)


def llama(**overrides) -> GPTConfig:
    kw = dict(
        position_embedding_type="rope",
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        num_query_groups=2,
    )
    kw.update(overrides)
    return tiny(**kw)


def tokens(b=2, s=S, seed=0) -> torch.Tensor:
    return torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(seed))


CONFIGS = {"gpt": tiny, "llama": llama}


def test_config_defaults_and_validation():
    c = tiny()
    assert (c.num_query_groups, c.kv_channels, c.ffn_hidden_size) == (4, 16, 256)
    assert c.max_position_embeddings == S
    assert tiny(activation="swiglu").ffn_hidden_size == 192  # int(8/3*64)=170 -> 192
    with pytest.raises(ValueError, match="num_query_groups"):
        tiny(num_query_groups=3)
    with pytest.raises(ValueError, match="normalization"):
        tiny(normalization="BatchNorm")
    with pytest.raises(ValueError, match="position_embedding_type"):
        tiny(position_embedding_type="alibi")
    assert pad_vocab_size(50257, 128) == 50304
    assert pad_vocab_size(50304, 128) == 50304
    assert pad_vocab_size(50257, 128, tp_size=2) == 50432


def test_from_model_section_copies_by_name():
    section = SimpleNamespace(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=2,
        seq_length=8,
        normalization="RMSNorm",
        make_vocab_size_divisible_by=128,  # not a model field: ignored
    )
    c = GPTConfig.from_model_section(section, vocab_size=256)
    assert (c.num_layers, c.hidden_size, c.vocab_size, c.normalization) == (3, 32, 256, "RMSNorm")
    assert c.activation == "gelu"  # absent -> default
    d = GPTConfig.from_model_section(vars(section), vocab_size=256)
    assert d == c


@pytest.mark.parametrize("name", CONFIGS)
def test_shapes_and_loss_matches_cross_entropy(name):
    torch.manual_seed(0)
    model = GPTModel(CONFIGS[name]())
    t, labels = tokens(), tokens(seed=1)
    logits = model(t)
    assert logits.shape == (2, S, V) and logits.dtype == torch.float32
    loss = model(t, labels=labels)
    assert loss.shape == (2, S) and loss.dtype == torch.float32
    ref = F.cross_entropy(logits.view(-1, V), labels.view(-1), reduction="none").view(2, S)
    torch.testing.assert_close(loss, ref)
    # Untrained model with small init: loss near log(V).
    assert abs(loss.mean().item() - math.log(V)) < 0.5


@pytest.mark.parametrize("name", CONFIGS)
def test_causal(name):
    torch.manual_seed(0)
    model = GPTModel(CONFIGS[name]()).eval()
    t = tokens()
    t2 = t.clone()
    t2[:, 10] = (t2[:, 10] + 1) % V
    a, b = model(t), model(t2)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_rope_is_relative():
    """With RoPE and no learned positions, shifting every position id changes nothing."""
    torch.manual_seed(0)
    model = GPTModel(llama(max_position_embeddings=64)).eval()
    t = tokens()
    pos = torch.arange(S)[None]
    torch.testing.assert_close(model(t, position_ids=pos), model(t, position_ids=pos + 7))


def test_tied_and_untied_heads():
    tied = GPTModel(tiny())
    assert tied.output_layer is None
    names = [n for n, _ in tied.named_parameters()]
    assert "word_embeddings.weight" in names and not any("output" in n for n in names)
    untied = GPTModel(tiny(untie_embeddings_and_output_weights=True))
    assert isinstance(untied.output_layer, Linear)
    assert untied.output_layer.weight is not untied.word_embeddings.weight
    assert untied.output_layer.weight.data_ptr() != untied.word_embeddings.weight.data_ptr()
    assert untied.num_parameters() == tied.num_parameters() + V * 64
    assert untied.num_parameters(exclude_embeddings=True) == tied.num_parameters(True)


def test_gqa_param_counts():
    h, d, L = 64, 16, 2
    mha = GPTModel(tiny()).num_parameters()
    assert GPTModel(tiny(num_query_groups=4)).num_parameters() == mha
    # Two fewer groups of k and v per layer: 2 * (kv weight rows + bias) saved per group.
    saved = L * 2 * 2 * (d * h + d)
    assert GPTModel(tiny(num_query_groups=2)).num_parameters() == mha - saved
    model = GPTModel(tiny(num_query_groups=1))
    assert model.layers[0].attention.qkv.weight.shape == ((4 + 2) * d, h)
    assert model(tokens()).isfinite().all()


def test_qkv_layout_against_reference_attention():
    """Pins the per-query-group interleaved QKV layout (module docstring of transformer.py)."""
    torch.manual_seed(0)
    cfg = tiny(num_attention_heads=4, num_query_groups=2)
    attn = SelfAttention(cfg)
    nn.init.normal_(attn.qkv.bias)
    x = torch.randn(2, S, 64)
    G, r, d = 2, 2, 16
    qkv = x @ attn.qkv.weight.T + attn.qkv.bias  # [b, s, G*(r+2)*d]
    qkv = qkv.view(2, S, G, r + 2, d)
    heads = []
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    for head in range(4):
        g, j = divmod(head, r)
        q, k, v = qkv[:, :, g, j], qkv[:, :, g, r], qkv[:, :, g, r + 1]  # [b, s, d]
        scores = (q @ k.transpose(1, 2)) / math.sqrt(d)
        scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(scores.softmax(-1) @ v)
    ref = torch.cat(heads, dim=-1) @ attn.proj.weight.T + attn.proj.bias
    torch.testing.assert_close(attn(x), ref, atol=1e-5, rtol=1e-5)


def test_switches_change_module_types():
    gpt, lm = GPTModel(tiny()), GPTModel(llama())
    assert isinstance(gpt.final_norm, nn.LayerNorm) and isinstance(lm.final_norm, RMSNorm)
    assert isinstance(lm.layers[0].input_norm, RMSNorm)
    assert gpt.position_embeddings is not None and lm.position_embeddings is None
    assert not gpt.layers[0].mlp.swiglu and lm.layers[0].mlp.swiglu
    f = lm.config.ffn_hidden_size
    assert lm.layers[0].mlp.fc1.weight.shape == (2 * f, 64)
    assert lm.layers[0].mlp.fc1.bias is None
    assert isinstance(lm.layers[0].mlp, MLP)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_gemm_is_an_fp8train_linear(name):
    model = GPTModel(CONFIGS[name](), BuildContext(get_recipe("te")))
    linears = dict(model.linear_modules())
    expected = {
        f"layers.{i}.{leaf}"
        for i in range(2)
        for leaf in ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2")
    }
    if model.output_layer is not None:
        expected.add("output_layer")
    assert set(linears) == expected
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) or type(m).__name__ == "Linear":
            assert isinstance(m, Linear), n


def _te_copy(model: GPTModel) -> GPTModel:
    te = GPTModel(model.config, BuildContext(get_recipe("te")))
    missing, unexpected = te.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected
    params = {n for n, _ in te.named_parameters()}
    assert not params & set(missing), "all parameters must load from the fp32 model"
    return te


@pytest.mark.parametrize("name", CONFIGS)
def test_te_loss_close_to_fp32_and_grads_finite(name):
    torch.manual_seed(0)
    ref = GPTModel(CONFIGS[name]())
    te = _te_copy(ref)
    t, labels = tokens(), tokens(seed=1)
    ref_loss = ref(t, labels=labels).mean()
    te_loss = te(t, labels=labels).mean()
    assert abs(te_loss.item() - ref_loss.item()) / ref_loss.item() < 0.02
    # The loss of an untrained model sits near log(V) whatever the logits do, so also bound
    # the logit error: SQNR of the (centred) logits >= 20 dB, the FP8 linear floor.
    with torch.no_grad():
        a, b = ref(t), te(t)
        a = a - a.mean(-1, keepdim=True)
        b = b - b.mean(-1, keepdim=True)
        sqnr = 20 * math.log10(a.norm() / (a - b).norm())
    assert sqnr > 20, sqnr
    te_loss.backward()
    for n, p in te.named_parameters():
        assert p.grad is not None and p.grad.isfinite().all(), n


def test_fp8_buffers_in_state_dict():
    fp32 = GPTModel(tiny())
    te = GPTModel(tiny(), BuildContext(get_recipe("te")))
    extra = set(te.state_dict()) - set(fp32.state_dict())
    for i in range(2):
        for leaf in ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2"):
            prefix = f"layers.{i}.{leaf}."
            assert any(k.startswith(prefix) for k in extra), prefix
    assert not any(k.startswith(("word_embeddings", "final_norm")) for k in extra)


def test_fp8_stats_names():
    torch.manual_seed(0)
    model = GPTModel(tiny(), BuildContext(get_recipe("te")))
    model(tokens(), labels=tokens(seed=1)).mean().backward()
    stats = model.fp8_stats()
    if hasattr(Linear, "fp8_stats"):
        assert "layers.0.attention.qkv" in stats and "layers.1.mlp.fc2" in stats
    assert GPTModel(tiny()).fp8_stats() == {}


@pytest.mark.parametrize("name", CONFIGS)
def test_bf16_params_forward(name):
    torch.manual_seed(0)
    model = GPTModel(CONFIGS[name]()).to(torch.bfloat16)
    loss = model(tokens(), labels=tokens(seed=1))
    assert loss.dtype == torch.float32 and loss.isfinite().all()
    assert abs(loss.mean().item() - math.log(V)) < 0.5
    loss.mean().backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_meta_build_then_init():
    torch.manual_seed(0)
    model = GPTModel(llama(), BuildContext(device="meta"))
    assert model.word_embeddings.weight.is_meta
    model.to_empty(device="cpu")
    model.init_weights()
    assert model(tokens()).isfinite().all()


def test_init_scaled_output_projections():
    torch.manual_seed(0)
    cfg = tiny(num_layers=8, hidden_size=128, init_method_std=0.02)
    model = GPTModel(cfg)
    layer = model.layers[0]
    assert abs(layer.attention.qkv.weight.std().item() - 0.02) < 2e-3
    assert abs(layer.mlp.fc2.weight.std().item() - 0.02 / 4) < 5e-4  # 1/sqrt(2*8) = 1/4
    assert abs(layer.attention.proj.weight.std().item() - 0.02 / 4) < 5e-4
    assert (layer.attention.qkv.bias == 0).all() and (layer.input_norm.weight == 1).all()


@pytest.mark.parametrize("level", ["fp32", "te"])
def test_overfits_fixed_batch(level):
    torch.manual_seed(0)
    model = GPTModel(llama(num_layers=1), BuildContext(get_recipe(level)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    t = tokens(b=4)
    inputs, labels = t[:, :-1], t[:, 1:]
    first = None
    for _ in range(30):
        loss = model(inputs, labels=labels).mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.3 * first, (first, loss.item())
