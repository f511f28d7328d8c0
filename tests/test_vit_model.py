"""ViT classifier: Hugging Face ``ViTForImageClassification`` logits and gradients (a randomly
initialised model built locally from a config and saved with ``save_pretrained``), export back
to transformers, position interpolation, pipeline stages cut from the single-process model, and
tensor (+ sequence) parallelism against one process on 2 gloo ranks (CPU, seconds)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # a test dependency (requirements.txt): the independent reference
from multiproc import end_worker

from families.vit_hf import ViTHFAdapter
from fp8train.precision import get_recipe
from models.context import BuildContext
from models.vit import ViTConfig, ViTModel, interpolate_position_embeddings, patchify
from parallel.pipeline.layout import PipelineLayout

IMAGE, PATCH, CHANNELS, CLASSES, H, HEADS = 8, 2, 3, 5, 32, 4
HF = ViTHFAdapter()


def _hf_config(**extra) -> transformers.ViTConfig:
    return transformers.ViTConfig(
        hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=4 * H,
        image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS, num_labels=CLASSES,
        layer_norm_eps=1e-6, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        **extra,
    )  # fmt: skip


def _perturb(model: torch.nn.Module) -> None:
    """Non-trivial norms, biases and tokens, so that a swapped tensor would show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith(("bias", "token", "class_token.weight")):
                p.add_(0.1 * torch.randn_like(p))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(_hf_config())
    _perturb(model)
    path = tmp_path_factory.mktemp("hf_vit")
    model.save_pretrained(path)
    return path


def _images(n: int = 3, size: int = IMAGE) -> torch.Tensor:
    return torch.randn(n, CHANNELS, size, size, generator=torch.Generator().manual_seed(3))


def _small(**overrides) -> ViTConfig:
    fields = dict(
        num_layers=4, hidden_size=H, num_attention_heads=HEADS, image_size=IMAGE,
        patch_size=PATCH, num_classes=CLASSES, num_channels=CHANNELS,
    )  # fmt: skip
    fields.update(overrides)
    return ViTConfig(**fields)


def _ours(hf_dir, **kw) -> tuple[ViTModel, ViTConfig]:
    config, state = HF.load(hf_dir, **kw)
    model = ViTModel(config).eval()
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and not result.missing_keys, result
    return model, config


def test_patchify_is_the_stride_p_convolution():
    torch.manual_seed(1)
    conv = torch.nn.Conv2d(CHANNELS, H, PATCH, stride=PATCH)
    x = _images()
    want = conv(x).flatten(2).transpose(1, 2)  # [b, N, h], row-major patches
    got = patchify(x, PATCH) @ conv.weight.reshape(H, -1).T + conv.bias
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_logits_match_hugging_face(hf_dir):
    hf = transformers.ViTForImageClassification.from_pretrained(hf_dir).eval()
    model, _ = _ours(hf_dir)
    x = _images()
    with torch.no_grad():
        want = hf(pixel_values=x).logits
        got = model(x)["logits"]
    assert (got - want).abs().max() <= 1e-5


def test_adapter_round_trip_restores_every_hugging_face_tensor(hf_dir):
    from safetensors.torch import load_file

    hf = load_file(str(hf_dir / "model.safetensors"))
    _, config = _ours(hf_dir)
    back = HF.state_to_hf(HF.state_from_hf(hf, config), config)
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    fields = HF.config_to_hf(config)
    saved = json.loads((hf_dir / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "image_size",
                "patch_size", "num_channels", "layer_norm_eps", "hidden_act"):  # fmt: skip
        assert fields[key] == saved[key], key


def test_sharded_directory_loads_like_the_single_file(hf_dir, tmp_path):
    """``save_pretrained`` above ``max_shard_size`` writes model.safetensors.index.json and
    shards: ``load_pretrained`` (the family's import) reads them and gives the single file's
    logits, transformers' to 1e-5, and the import the same tensors and class names."""
    from families import get_family, load_pretrained

    hf = transformers.ViTForImageClassification.from_pretrained(hf_dir).eval()
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert (tmp_path / "model.safetensors.index.json").exists() and len(shards) > 1
    assert not (tmp_path / "model.safetensors").exists()
    x = _images()
    with torch.no_grad():
        want = hf(pixel_values=x).logits
        single = load_pretrained(hf_dir)(x)
        sharded = load_pretrained(tmp_path)(x)
    assert torch.equal(sharded, single) and (sharded - want).abs().max() <= 1e-5
    vit = get_family("vit")
    a, b = vit.import_hf(hf_dir), vit.import_hf(tmp_path)
    assert a.structure == b.structure
    assert a.structure["classes"] == [hf.config.id2label[i] for i in range(CLASSES)]
    assert set(a.tensors) == set(b.tensors)
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def _disk_name(hf_dir, param: torch.Tensor) -> str:
    """The file key of a transformers parameter: transformers 5 names ViT's modules
    differently in memory (``q_proj``) than in its files (``attention.attention.query``), and
    the adapter speaks the files' names. Every saved tensor is distinct (random, perturbed)."""
    from safetensors.torch import load_file

    saved = load_file(str(hf_dir / "model.safetensors"))
    (key,) = [k for k, v in saved.items() if v.shape == param.shape and torch.equal(v, param)]
    return key


def test_loss_and_every_gradient_match_hugging_face(hf_dir):
    """Training follows transformers: the cross entropy and every parameter's gradient (the
    patch projection flattened, Q/K/V split back per head) equal ViTForImageClassification's."""
    hf = transformers.ViTForImageClassification.from_pretrained(hf_dir).train()
    model, config = _ours(hf_dir)
    model.train()
    x, labels = _images(4), torch.tensor([0, 3, 1, 4])
    want = hf(pixel_values=x, labels=labels).loss
    want.backward()
    logits = model(x)["logits"]
    got = torch.nn.functional.cross_entropy(logits, labels)
    got.backward()
    assert abs(got.item() - want.item()) <= 1e-6
    ours = HF.state_to_hf({n: p.grad for n, p in model.named_parameters()}, config)
    theirs = {_disk_name(hf_dir, p): p.grad for _, p in hf.named_parameters()}
    assert set(ours) == set(theirs)
    # The attention key bias has an exactly-zero true gradient (softmax ignores a constant
    # added to every score): both sides hold rounding noise, compared in magnitude.
    key_bias = [n for n in theirs if n.endswith("attention.key.bias")]
    assert key_bias and all(ours[n].abs().max() < 1e-6 for n in key_bias)
    errors = {
        n: ((ours[n] - g).norm() / g.norm().clamp(min=1e-12)).item()
        for n, g in theirs.items()
        if n not in key_bias
    }
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_exported_model_gives_the_same_logits_in_transformers(tmp_path):
    torch.manual_seed(11)
    config = _small(num_layers=2, norm_epsilon=1e-6)
    ours = ViTModel(config).eval()
    _perturb(ours)
    classes = [f"c{i}" for i in range(CLASSES)]
    HF.save(tmp_path, dict(ours.named_parameters()), config, classes=classes)
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path).eval()
    assert hf.config.id2label[2] == "c2"
    x = _images()
    with torch.no_grad():
        want = ours(x)["logits"]
        got = hf(pixel_values=x).logits
    assert (got - want).abs().max() <= 1e-4
    config_back, state = HF.load(tmp_path)
    assert config_back == config
    params = dict(ours.named_parameters())
    assert set(state) == set(params) and all(torch.equal(state[k], params[k]) for k in state)


def test_import_at_another_image_size_interpolates_the_positions(hf_dir):
    """Loading at 12 px (a 6x6 grid instead of 4x4) resizes the patch positions bicubically as
    transformers' interpolate_pos_encoding does; the class token's row is kept."""
    hf = transformers.ViTForImageClassification.from_pretrained(hf_dir).eval()
    model, config = _ours(hf_dir, image_size=12)
    assert config.num_patches == 36
    table = model.position_embeddings.weight
    original = hf.vit.embeddings.position_embeddings[0]
    assert torch.equal(table[0], original[0])
    x = _images(2, size=12)
    with torch.no_grad():
        got = model(x)["logits"]
        want = hf(pixel_values=x, interpolate_pos_encoding=True).logits
    # transformers interpolates in its own way (scale factors, antialias off): close, not equal
    assert (got - want).abs().max() < 0.05
    same = interpolate_position_embeddings(original.detach(), 4)
    assert torch.equal(same, original.detach())


def test_every_transformer_gemm_is_fp8_and_the_rest_is_not():
    model = ViTModel(_small(), BuildContext(get_recipe("te")))
    fp8 = {name for name, m in model.linear_modules() if m.fp8}
    assert fp8 == {f"layers.{i}.{n}" for i in range(4) for n in ("attention.qkv",
        "attention.proj", "mlp.fc1", "mlp.fc2")}  # fmt: skip
    with pytest.raises(ValueError, match="multiple of model.patch_size"):
        _small(image_size=9)


@pytest.mark.parametrize("virtual", [1, 2])
def test_pipeline_stages_are_cut_from_the_single_process_model(virtual):
    torch.manual_seed(5)
    ref = ViTModel(_small()).eval()
    whole = ref.state_dict()
    after = torch.rand(3)
    stages = []
    for stage in range(2):
        torch.manual_seed(5)
        part = ViTModel(_small(), pipeline=PipelineLayout(4, 2, virtual, stage)).eval()
        assert torch.equal(torch.rand(3), after)  # the RNG moved as in the whole build
        state = part.state_dict()
        assert all(torch.equal(state[k], whole[k]) for k in state)
        stages.append(part)
    inputs = {"images": _images()}
    with torch.no_grad():
        want = ref.forward_chunk(0, None, inputs)["logits"]
        hidden = None
        for chunk in range(virtual):
            for stage in range(2):
                hidden = stages[stage].forward_chunk(chunk, hidden, inputs)
    torch.testing.assert_close(hidden["logits"], want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Tensor (+ sequence) parallelism against one process, 2 gloo ranks (fp32 and te). Under SP the
# 17-token sequence is padded to 18 with masked rows.

# te: each weight shard has its own FP8 scales, so shards round differently. On these 4 images
# FP8 itself moves single-process gradients by up to 0.27 relative per tensor (te against fp32,
# measured: layer norms and fc1 of the middle layers); TP at te differs from one process at te
# by up to 0.33 on the same tensors.
TP_LEVELS = {"fp32": 1e-5, "te": 0.5}


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
    x, labels = _images(4), torch.tensor([0, 3, 1, 4])
    results = tensor_parallel_errors(
        TP_LEVELS,
        lambda ctx: ViTModel(_small(), ctx),
        lambda model: torch.nn.functional.cross_entropy(model(x)["logits"], labels),
    )
    if rank == 0:
        Path(out_dir, "results.json").write_text(json.dumps(results))
    end_worker()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("vit_tp")
    mp.start_processes(
        _tp_worker, args=(2, str(out / "init"), str(out)), nprocs=2, start_method="fork"
    )  # forked: inherits the imports
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("layout", ["tp", "tp_sp"])
@pytest.mark.parametrize("level", list(TP_LEVELS))
def test_tensor_parallel_loss_and_every_gradient_match_one_process(tp_results, level, layout):
    r = tp_results[f"{level}/{layout}"]
    assert r["names"]
    assert r["loss"] < (1e-6 if level == "fp32" else 1e-3), r
    assert r["grads"][0] < TP_LEVELS[level], r  # [worst relative error, its tensor]
