"""tools/convert_checkpoint.py and families.load_pretrained against transformers itself.

Every Hugging Face model is random and built locally from a config (``save_pretrained`` to a
temp dir), with a vocabulary of 1000 (not a multiple of 128, so padding is added on import and
removed on export). GPT-2, Llama (GQA), RoBERTa and ViT: the round trip HF -> native (TP=2 x
PP=2) -> HF must give every on-disk tensor bitwise back; ``load_pretrained`` on the converted
checkpoint (and on the HF directory) must give transformers' logits at fp32 (max abs diff
<= 1e-4; measured 6e-8 GPT-2 and Llama, 0 RoBERTa, 1.5e-8 ViT).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import transformers  # a test dependency (requirements.txt): the independent reference
from conftest import REPO, tiny_overrides
from safetensors.torch import load_file

from families import load_pretrained
from tools.convert_checkpoint import main as convert_main

V, H, LAYERS, HEADS, KV, POSITIONS = 1000, 32, 2, 4, 2, 32
LOGIT_TOL = 1e-4


def _hf_model(kind: str):
    """A random Hugging Face model of ``kind``, built locally."""
    if kind == "roberta":
        return transformers.RobertaForMaskedLM(transformers.RobertaConfig(
            vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            intermediate_size=4 * H, max_position_embeddings=POSITIONS + 2, type_vocab_size=1,
            layer_norm_eps=1e-5,
        ))  # fmt: skip
    if kind == "vit":
        return transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=8, patch_size=2, num_channels=3, hidden_size=H, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, intermediate_size=4 * H, num_labels=5,
        ))  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(_hf_config(kind))


def _inputs(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    if kind == "vit":
        return torch.randn(2, 3, 8, 8, generator=g)
    return torch.randint(3, V, (2, 16), generator=g)  # above RoBERTa's special ids


def _hf_config(kind: str):
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=V, n_embd=H, n_layer=LAYERS, n_head=HEADS, n_positions=POSITIONS,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
    return transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV, intermediate_size=48, max_position_embeddings=POSITIONS,
        rms_norm_eps=1e-5, rope_theta=500.0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


def _save_tokenizer(kind: str, directory) -> list[str]:
    """What a Hugging Face model directory carries besides the model, built locally: a small
    BPE tokenizer (text models) or an image processor config (ViT). Returns the file names."""
    if kind == "vit":
        transformers.ViTImageProcessor(size={"height": 8, "width": 8}).save_pretrained(directory)
        return ["preprocessor_config.json"]
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = ["def f(x):\n    return x + 1\n", "import os, sys\nprint(sys.argv)\n"] * 20
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<unk>")
    return sorted(p.name for p in map(Path, fast.save_pretrained(directory)))


def _convert(*args: str) -> str:
    """``tools/convert_checkpoint.py ARGS`` through its ``main`` in this process (no fresh
    interpreter and imports per call); what it wrote to stderr. It must succeed."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = convert_main(list(args))
    assert code == 0, err.getvalue()[-3000:]
    return err.getvalue()


@pytest.fixture(scope="module", params=["gpt2", "llama", "roberta", "vit"])
def converted(request, tmp_path_factory):
    """(kind, HF dir, native TP=2 x PP=2 checkpoints dir, HF dir exported back)."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"convert_{kind}")
    torch.manual_seed(0)
    model = _hf_model(kind)
    with torch.no_grad():  # non-trivial norms and biases, so a swapped tensor would show
        for name, p in model.named_parameters():
            if any(k in name.lower() for k in ("norm", "ln_")) or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(root / "hf")
    _save_tokenizer(kind, root / "hf")
    native, back = root / "native", root / "back"
    err = _convert("--input", str(root / "hf"), "--output", str(native), "--format", "native",
                   "--tensor", "2", "--pipeline", "2")  # fmt: skip
    assert "[1/" in err  # progress, one line per tensor
    _convert("--input", str(native), "--output", str(back), "--format", "hf")
    return kind, root / "hf", native, back


def test_round_trip_gives_every_tensor_bitwise_back(converted):
    kind, hf, native, back = converted
    files = sorted(p.name for p in (native / "iter_0000000").iterdir())
    assert files == ["metadata.json"] + [
        f"model_tp{t}_pp{p}.safetensors" for t in range(2) for p in range(2)
    ] + ["tokenizer"]
    # The tokenizer (or image processor) files travel in and out unchanged.
    carried = sorted(p.name for p in (native / "iter_0000000" / "tokenizer").iterdir())
    assert carried and carried == sorted(p.name for p in hf.iterdir() if p.name in carried)
    for name in carried:
        assert (back / name).read_bytes() == (hf / name).read_bytes(), name
    meta = json.loads((native / "iter_0000000" / "metadata.json").read_text())
    assert meta["weights_only"]
    if kind != "vit":
        assert meta["model_structure"]["padded_vocab_size"] == 1024
    want, got = load_file(hf / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    config = json.loads((back / "config.json").read_text())
    assert config["model_type"] == kind
    if kind != "vit":
        assert config["vocab_size"] == V


def test_an_imported_model_generates_with_its_own_tokenizer(converted):
    """tools/generate.py finds the tokenizer an import carried: no --tokenizer needed."""
    from tools.generate import checkpoint_tokenizer

    kind, hf, native, _ = converted
    if kind != "gpt2":
        pytest.skip("one family is enough")
    tokenizer = checkpoint_tokenizer(native)
    reference = transformers.AutoTokenizer.from_pretrained(hf)
    text = "def f(x):\n    return x + 1\n"
    assert tokenizer.encode(text) == reference(text, add_special_tokens=False)["input_ids"]


def test_load_pretrained_gives_transformers_logits(converted):
    kind, hf_dir, native, _ = converted
    hf = type(_hf_model(kind)).from_pretrained(hf_dir).eval()
    x = _inputs(kind)
    with torch.no_grad():
        want = hf(x).logits
        for source in (native, hf_dir):  # the converted checkpoint and the HF directory itself
            model = load_pretrained(source)
            assert not model.training
            got = model(x)
            expect = (2, 5) if kind == "vit" else (2, 16, 1024)
            assert got.shape == expect
            diff = (got[..., : want.shape[-1]] - want).abs().max().item()
            print(f"\n{kind} from {source.name}: max |logit diff| = {diff:.2e}")
            assert diff <= LOGIT_TOL


def test_bad_inputs_exit_2_with_one_line_and_write_nothing(converted, tmp_path, capsys):
    from tools.convert_checkpoint import main

    kind, hf, native, _ = converted
    if kind != "gpt2":
        pytest.skip("one family is enough")
    cases = [
        (["--input", str(tmp_path / "missing"), "--output", str(tmp_path / "a")], "no such"),
        (["--input", str(hf), "--output", str(native)], "not empty"),
        (["--input", str(hf), "--output", str(tmp_path / "b"), "--tensor", "3"], "tensor"),
        (["--input", str(hf), "--output", str(tmp_path / "c"), "--format", "hf"], "already"),
    ]
    for args, needle in cases:
        if "--format" not in args:
            args = args + ["--format", "native"]
        code = main(args + ["--quiet"])
        lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert code == 2 and len(lines) == 1, lines
        assert lines[0].startswith("error: ") and needle in lines[0], lines
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


def test_weights_only_checkpoint_needs_finetune(converted, tiny_data, tmp_path):
    """An imported checkpoint holds no optimizer state: resuming from it is refused in one
    line naming checkpoint.finetune."""
    from training.config import ConfigError, load_config
    from training.loop import pretrain

    kind, _, native, _ = converted
    if kind != "gpt2":
        pytest.skip("one family is enough")
    overrides = tiny_overrides(tiny_data, tmp_path, "fp32", **{"checkpoint.load": str(native)})
    cfg = load_config(str(REPO / "configs/gpt_tiny.yaml"), overrides)
    with pytest.raises(ConfigError, match="checkpoint.finetune=true"):
        pretrain(cfg)
