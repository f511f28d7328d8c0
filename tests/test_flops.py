"""Megatron's FLOPs formula, checked against a hand count of the GEMMs of one layer."""

from families.gpt import gpt_flops_per_step
from training.flops import peak_tflops_for


def test_formula_matches_hand_counted_gemms():
    b, s, L, h, V, heads = 2, 16, 3, 64, 100, 4
    f = 4 * h
    # Forward multiply-accumulates per token per layer: QKV 3h^2; scores and values 2*s*h,
    # halved because the mask is causal; projection h^2; MLP 2*h*f. Plus the output head h*V.
    # Training = 3 passes (fwd + 2x bwd) x 2 FLOPs per MAC = 6 x MACs.
    fwd_macs_per_token = L * (3 * h * h + s * h + h * h + 2 * h * f) + h * V
    expected = 6 * b * s * fwd_macs_per_token
    got = gpt_flops_per_step(
        batch=b,
        seq=s,
        layers=L,
        hidden=h,
        vocab=V,
        heads=heads,
        query_groups=heads,
        kv_channels=h // heads,
        ffn=f,
        swiglu=False,
    )
    assert got == expected


def test_gqa_and_swiglu_terms():
    common = dict(batch=1, seq=8, layers=1, hidden=32, vocab=10, heads=4, kv_channels=8, ffn=64)
    full = gpt_flops_per_step(query_groups=4, swiglu=False, **common)
    gqa = gpt_flops_per_step(query_groups=2, swiglu=False, **common)
    assert full - gqa == 6 * 8 * 32 * (2 * 8 * 2)  # two fewer K and V heads of 8 channels
    swiglu = gpt_flops_per_step(query_groups=4, swiglu=True, **common)
    assert swiglu - full == 6 * 8 * 32 * 64


def test_known_peaks():
    assert peak_tflops_for("NVIDIA H200", "fp8") == 1979.0
    assert peak_tflops_for("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops_for("AMD EPYC", "fp32") is None


def test_family_flops_equal_the_formula():
    """The GPT family's count (the blocks' ``layer_flops_per_step`` plus the head) is
    Megatron's formula; a bidirectional mask counts the score and value GEMMs twice."""
    from families.gpt import GPTFamily
    from models.gpt import GPTConfig

    c = GPTConfig(
        num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=16,
        vocab_size=128, activation="swiglu",
    )  # fmt: skip
    expected = gpt_flops_per_step(
        batch=2, seq=16, layers=3, hidden=64, vocab=128, heads=4, query_groups=2,
        kv_channels=16, ffn=c.ffn_hidden_size, swiglu=True,
    )  # fmt: skip
    assert GPTFamily().flops_per_step(c, 2) == expected
    extra = c.layer_flops_per_step(2, 16, causal=False) - c.layer_flops_per_step(2, 16)
    assert extra == 6.0 * 2 * 16 * 3 * (16 * 4) * 16  # one more q·s per layer
