"""RoBERTa masked-LM pretraining end to end: the real entry point, every parallel layout against
one process, resume, and the family's input errors.

Data: the 40-file stdlib corpus of ``tiny_data`` (tests/conftest.py) with a 512-piece
tokenizer that has the ``<mask>`` control symbol (``tiny_mlm_data``, built once per module).
Model: ``configs/roberta_tiny.yaml`` shrunk by ``roberta_overrides`` to 2 post-LN layers,
hidden 64, 2 heads, 32 positions, 2 micro-batches of 2 per step, 6 steps at lr 1e-2 (so that
some masked tokens are predicted right by the end), evaluating at 3 and 6.

- Through ``pretrain_roberta.py`` under torchrun, 2 data-parallel ranks at te (dropout 0.1):
  the family's metrics and their validation twins, a ``roberta`` checkpoint.
- fp32, dropout 0, same seed and data: TP=2 with sequence parallelism, PP=2 and DP=2 against
  the single process. Every logged loss (training and validation) within 1e-5 relative, the
  fp32 equivalence bar (tests/test_tp_training.py, tests/test_entry_point.py,
  tests/test_model_family.py), and every final weight, reassembled from the last checkpoint,
  under the same names within 1e-4 relative L2 per tensor (``multiproc.ADAM_WEIGHT_BAR``: Adam
  magnifies the rounding of near-eps gradient elements), except the attention key biases
  (exactly-zero true gradient: rounding noise in every run, checked to stay below 1e-5 in
  magnitude, as tests/test_model_family.py does). The masked-LM accuracy, a count ratio, must
  be equal. The same with the binary head (``*_sop``: pairs, two token types, sop loss and
  accuracy too) for TP=2+SP and PP=2 against its own single process. Full-sentence packing
  pads most samples, so every comparison runs on padded batches (checked). Measured: DP=2
  losses and weights bitwise equal (2 ranks x 1 micro-batch add the same two gradients as 1
  rank x 2); DP=2 distributed, TP=2+SP and PP=2 losses <= 1.6e-7, weights <= 6.7e-7 (worst on
  a ``qkv.bias``); with the binary head losses <= 2.1e-7, weights <= 5.3e-6 (TP=2+SP, the
  position embedding); key biases <= 5.3e-6 in magnitude; accuracies equal.
- Resume at te with dropout 0.1: 3 steps, then resumed to 6, on 2 ranks, logs bitwise the
  losses and accuracies of the straight torchrun run above (data order, dynamic masking, RNG,
  FP8 state, optimizer and scheduler all come back from the checkpoint).
- Errors: a tokenizer without ``<mask>`` exits 2 with one line naming the key.

The layouts run as forked ranks (one process, then one pair running them one after the other,
as tests/test_model_family.py does): seconds instead of a torchrun start per layout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import REPO
from multiproc import ADAM_WEIGHT_BAR, launch, rank_env, reassembled_errors, run_ranks, torchrun

CONFIG = str(REPO / "configs/roberta_tiny.yaml")
ENTRY = "pretrain_roberta.py"
STEPS = 6
TOLERANCE = 1e-5  # fp32: the project's equivalence bar
FP32 = {"model.hidden_dropout": 0.0, "model.attention_dropout": 0.0}
TE = {"model.hidden_dropout": 0.1, "model.attention_dropout": 0.1}
# name -> (world size, overrides) of the fp32 layouts
LAYOUTS = {
    "single": (1, {}),
    "tp2_sp": (2, {"parallel.tensor": 2, "parallel.sequence_parallel": "true"}),
    "pp2": (2, {"parallel.pipeline": 2}),
    "dp2": (2, {}),
    "dp2_dist": (2, {"optimizer.distributed": "true"}),  # ZeRO-1: per-rank optimizer shards
    # The binary (sentence-order) head: segment pairs, two token types, the pooler on the
    # gathered sequence under SP, the pair labels on the last pipeline stage.
    "single_sop": (1, {"model.add_binary_head": "true"}),
    "tp2_sp_sop": (2, {"model.add_binary_head": "true", "parallel.tensor": 2,
                       "parallel.sequence_parallel": "true"}),
    "pp2_sop": (2, {"model.add_binary_head": "true", "parallel.pipeline": 2}),
}  # fmt: skip
PARALLEL = [name for name in LAYOUTS if not name.startswith("single")]
SOP_KEYS = ("sop loss", "sop accuracy")


def reference(layout: str) -> str:
    """The single-process run a layout is compared with."""
    return "single_sop" if layout.endswith("_sop") else "single"


@pytest.fixture(scope="module")
def tiny_mlm_data(tmp_path_factory):
    """``tiny_data``'s corpus and vocabulary size, tokenized with a ``<mask>`` piece."""
    from data.corpus import stdlib_documents, stdlib_root
    from data.prepare import prepare_corpus_data

    cache = tmp_path_factory.mktemp("mlm_data_cache")
    return prepare_corpus_data(
        cache, stdlib_documents()[:40], 512, root=stdlib_root(), name="tiny_mlm",
        control_symbols=("<mask>",),
    )  # fmt: skip


def roberta_overrides(data, run_dir, level="te", **extra) -> list[str]:
    """Overrides that shrink configs/roberta_tiny.yaml to a seconds-long job on ``data``."""
    values = {
        "model.num_layers": 2,
        "model.hidden_size": 64,
        "model.num_attention_heads": 2,
        "model.seq_length": 32,
        "data.corpus": "prefix",
        "data.data_prefix": data.data_prefix,
        "data.tokenizer_model": data.tokenizer_model,
        "data.cache_dir": str(Path(run_dir) / "cache"),
        "training.train_iters": STEPS,
        "training.micro_batch_size": 2,
        "training.global_batch_size": 4,
        "training.eval_interval": 3,
        "training.eval_iters": 1,
        "optimizer.lr": 1e-2,  # high enough that some masked tokens are right by step 6
        "optimizer.lr_warmup_iters": 1,
        "logging.interval": 1,
        "logging.dir": str(run_dir),
        "logging.tensorboard": "false",
        "logging.peak_tflops": 1.0,  # skips the CPU peak measurement
        "checkpoint.save_interval": 3,
        "precision.level": level,
        "precision.fp8_gemm_backend": "emulated",  # "auto" may pick another backend per run
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _checkpoint(run_dir: Path, iteration: int = STEPS) -> Path:
    return run_dir / "checkpoints" / f"iter_{iteration:07d}"


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from checkpoint.format import reassemble
    from checkpoint.store import latest_checkpoint

    path = latest_checkpoint(run_dir / "checkpoints")
    assert path == _checkpoint(run_dir), path
    return reassemble(path, "model")


def _metadata(run_dir: Path) -> dict:
    return json.loads((_checkpoint(run_dir) / "metadata.json").read_text())


# ---------------------------------------------------------------------------------------------
# Runs shared by the tests: one torchrun, one forked process, one forked pair.


@pytest.fixture(scope="module")
def entry_run(tiny_mlm_data, tmp_path_factory):
    """``pretrain_roberta.py`` under torchrun on 2 data-parallel ranks at te, dropout 0.1."""
    run_dir = tmp_path_factory.mktemp("roberta_entry") / "run"
    overrides = roberta_overrides(tiny_mlm_data, run_dir, "te", **TE)
    proc = torchrun(2, ["--config", CONFIG, *overrides], timeout=240, entry=ENTRY)
    return run_dir, proc


def _worker(rank: int, world: int, port: int, configs: list[list[str]]) -> None:
    """One rank of every run in ``configs`` (override lists), one after the other (later runs
    reuse the process group and add their own groups)."""
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    from parallel.topology import destroy_distributed
    from training.config import load_config
    from training.loop import pretrain

    for overrides in configs:
        pretrain(load_config(CONFIG, overrides, family="roberta"), family="roberta")
    destroy_distributed()


@pytest.fixture(scope="module")
def runs(tiny_mlm_data, tmp_path_factory) -> dict[str, Path]:
    """Every fp32 layout, and the te run stopped at 3 and resumed to 6 on 2 ranks; returns each
    run's directory (``resumed`` for the latter)."""
    import training.loop  # noqa: F401  (imported once here, inherited by the forked ranks)

    root = tmp_path_factory.mktemp("roberta_runs")
    dirs = {name: root / name for name in [*LAYOUTS, "resumed"]}
    resumed = [
        roberta_overrides(tiny_mlm_data, dirs["resumed"], "te", **TE, **extra)
        for extra in ({"training.exit_interval": 3}, {})
    ]
    for world in (1, 2):
        configs = [
            roberta_overrides(tiny_mlm_data, dirs[n], "fp32", **FP32, **extra)
            for n, (w, extra) in LAYOUTS.items()
            if w == world
        ]
        if world == 2:
            configs += resumed
        run_ranks(_worker, world, (configs,), timeout=300, start_method="fork")
    return dirs


# ---------------------------------------------------------------------------------------------
# 1. The entry point.


def test_entry_point_trains_and_logs_the_family_metrics(entry_run):
    run_dir, proc = entry_run
    assert "world 2 (tp 1 pp 1 dp 2)" in proc.stdout
    records = _records(run_dir)
    assert [r["iteration"] for r in records] == [*range(1, STEPS + 1)]
    for r in records:
        assert math.isfinite(r["lm loss"]) and 0.0 <= r["mlm accuracy"] <= 1.0
    validated = [r for r in records if "lm loss validation" in r]
    assert [r["iteration"] for r in validated] == [3, 6]
    for r in validated:
        assert math.isfinite(r["lm loss validation"])
        assert 0.0 <= r["mlm accuracy validation"] <= 1.0
        assert r["lm loss validation ppl"] == pytest.approx(math.exp(r["lm loss validation"]))

    meta = _metadata(run_dir)
    assert meta["family"] == "roberta" and meta["model_structure"]["family"] == "roberta"
    assert meta["iteration"] == STEPS and meta["config"]["precision"]["level"] == "te"
    weights = _final_weights(run_dir)
    assert {"word_embeddings.weight", "lm_bias.bias", "layers.0.post_mlp_norm.weight"} <= set(
        weights
    )
    vocab = meta["model_structure"]["padded_vocab_size"]
    assert weights["word_embeddings.weight"].shape == (vocab, 64)
    assert weights["lm_bias.bias"].shape == (vocab,)


# ---------------------------------------------------------------------------------------------
# 2. Parallel layouts against one process (fp32).


def loss_error(run_dir: Path, ref_dir: Path) -> float:
    """Worst relative error of the logged training and validation losses."""
    records, ref = _records(run_dir), _records(ref_dir)
    assert [r["iteration"] for r in records] == [r["iteration"] for r in ref]
    assert [r["iteration"] for r in ref] == [*range(1, STEPS + 1)]
    keys = ("lm loss", "lm loss validation", "sop loss", "sop loss validation")
    pairs = [(r[k], q[k]) for r, q in zip(records, ref) for k in keys if k in q]
    sop = "sop loss" in ref[0]
    assert len(pairs) == (STEPS + 2) * (2 if sop else 1)  # every step, evaluations at 3 and 6
    return max(abs(a - b) / abs(b) for a, b in pairs)


def weight_errors(run_dir: Path, ref_dir: Path) -> tuple[dict[str, float], float]:
    """Final weights of a run against the reference's (``multiproc.reassembled_errors``)."""
    structure = _metadata(ref_dir)["model_structure"]
    return reassembled_errors(_final_weights(run_dir), _final_weights(ref_dir), structure)


@pytest.mark.parametrize("layout", PARALLEL)
def test_layout_losses_match_single_process(runs, layout):
    assert loss_error(runs[layout], runs[reference(layout)]) < TOLERANCE


@pytest.mark.parametrize("layout", PARALLEL)
def test_layout_accuracy_matches_single_process(runs, layout):
    """The share of masked tokens predicted right (under TP: the argmax over vocabulary
    shards) is a count ratio: weights an FP32 ulp apart give the same argmaxes, so equal."""
    keys = ("mlm accuracy", "mlm accuracy validation", "sop accuracy", "sop accuracy validation")
    ref = [[r.get(k) for k in keys] for r in _records(runs[reference(layout)])]
    assert any(a for row in ref for a in row)  # some tokens are right: the check has teeth
    assert [[r.get(k) for k in keys] for r in _records(runs[layout])] == ref


@pytest.mark.parametrize("layout", PARALLEL)
def test_layout_final_weights_match_single_process(runs, layout):
    errors, key_bias = weight_errors(runs[layout], runs[reference(layout)])
    if layout.endswith("_sop"):
        assert {"pooler.weight", "binary_head.weight", "binary_head.bias"} <= set(errors)
    assert any("attention.qkv.bias" in name for name in errors)  # the mask had work to do
    assert max(errors.values()) < ADAM_WEIGHT_BAR, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    assert key_bias < 1e-5  # noise: 0.1% of one Adam step at lr 1e-2


def test_layouts_ran_as_named(runs):
    """Each layout's checkpoint holds its own split (per-stage / per-shard files)."""
    assert {p.name for p in _checkpoint(runs["pp2"]).iterdir()} >= {
        "model_pp0.safetensors",
        "model_pp1.safetensors",
    }
    assert {p.name for p in _checkpoint(runs["tp2_sp"]).iterdir()} >= {
        "model_tp0.safetensors",
        "model_tp1.safetensors",
    }
    assert {p.name for p in _checkpoint(runs["dp2_dist"]).iterdir()} >= {
        "optimizer_dp0.safetensors",
        "optimizer_dp1.safetensors",
    }
    assert {p.name for p in _checkpoint(runs["pp2_sop"]).iterdir()} >= {
        "model_pp0.safetensors",
        "model_pp1.safetensors",
    }
    for name in PARALLEL:
        assert _metadata(runs[name])["world_size"] == 2


def test_sop_runs_log_the_pair_metrics_and_others_do_not(runs):
    for name in LAYOUTS:
        records = _records(runs[name])
        sop = name.endswith("_sop")
        for r in records:
            assert all((k in r) == sop for k in SOP_KEYS), (name, r)
            assert ("sop loss validation" in r) == (sop and r["iteration"] in (3, 6))
        if sop:
            assert all(math.isfinite(r["sop loss"]) for r in records)
            assert all(0.0 <= r["sop accuracy"] <= 1.0 for r in records)


def test_layout_batches_are_padded_and_paired_as_configured(tiny_mlm_data, tmp_path):
    """What the layout runs read: full-sentence windows leave pads in most samples (so every
    layout above is checked on padded batches), and with the binary head the samples are pairs
    with two token types and both sop labels."""
    from families import get_family
    from training.config import load_config

    family = get_family("roberta")
    for binary in ("false", "true"):
        overrides = roberta_overrides(tiny_mlm_data, tmp_path, "fp32", **{
            "model.add_binary_head": binary})  # fmt: skip
        cfg = load_config(CONFIG, overrides, family="roberta")
        data = family.prepare_data(cfg, 0)
        train, _ = family.build_datasets(cfg, data, STEPS * 4, 4)
        items = [train[i] for i in range(STEPS * 4)]
        padded = sum(int(it["attention_mask"].min()) == 0 for it in items)
        assert padded >= len(items) // 2, padded
        if binary == "true":
            assert {int(it["sop_label"]) for it in items} == {0, 1}
            assert all(int(it["token_types"].max()) == 1 for it in items)
        else:
            assert "sop_label" not in items[0]


# ---------------------------------------------------------------------------------------------
# 3. Resume.


def test_resume_gives_identical_losses(entry_run, runs):
    """3 steps, then resumed to 6 (forked ranks), against the straight torchrun run: the same
    config on the same 2 ranks, so the losses must be equal to the bit."""
    resumed, straight = _records(runs["resumed"]), _records(entry_run[0])
    keys = ("lm loss", "mlm accuracy", "lm loss validation", "mlm accuracy validation")
    assert [r["iteration"] for r in resumed] == [*range(1, STEPS + 1)]
    assert [[r.get(k) for k in keys] for r in resumed] == [
        [r.get(k) for k in keys] for r in straight
    ]
    assert (runs["resumed"] / "checkpoints" / "latest").read_text().strip() == "iter_0000006"


# ---------------------------------------------------------------------------------------------
# 4. Errors: exit 2, one line naming the key, nothing written.


def _one_error_line(ranks, needle: str) -> None:
    code, _, err = ranks[0]
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines


@pytest.fixture(scope="module")
def no_mask_tokenizer_ranks(tiny_data, tmp_path_factory):
    """``pretrain_roberta.py`` on the GPT corpus (a tokenizer without ``<mask>``) as 2 plain
    ranks; the run directory and each rank's ``(exit code, stdout, stderr)``."""
    run_dir = tmp_path_factory.mktemp("roberta_no_mask") / "run"
    args = roberta_overrides(tiny_data, run_dir)
    return run_dir, launch(2, ["--config", CONFIG, *args], entry=ENTRY)


def test_tokenizer_without_mask_is_refused(no_mask_tokenizer_ranks):
    run_dir, ranks = no_mask_tokenizer_ranks
    _one_error_line(ranks, "data.tokenizer_model")
    assert "<mask>" in ranks[0][2]
    assert not run_dir.exists()


def test_tokenizer_without_mask_every_rank_exits_2_quietly(no_mask_tokenizer_ranks):
    _, ranks = no_mask_tokenizer_ranks
    assert [code for code, _, _ in ranks] == [2, 2], ranks[1][2][-2000:]
    assert not ranks[1][2].strip()  # one line in all, from rank 0


# ---------------------------------------------------------------------------------------------
# 5. Hugging Face export of a trained checkpoint.


@pytest.mark.parametrize("layout", ["single", "tp2_sp"])
def test_exported_checkpoint_gives_the_same_logits_in_transformers(runs, layout, tmp_path):
    """tools/export_hf.py on a trained checkpoint (one process, or TP=2+SP shards with a padded
    vocabulary split over them): transformers loads it and, on a padded batch, its logits equal
    this project's model with the reassembled weights (over the true vocabulary)."""
    import transformers

    from families.roberta import RobertaModelSection
    from models.roberta import RobertaModel
    from tools.export_hf import main as export_main

    # The tool's main in this process (the script as a process: tests/test_vit_training.py).
    args = ["--checkpoint", str(_checkpoint(runs[layout])), "--output", str(tmp_path / "hf")]
    assert export_main(args) == 0
    hf = transformers.RobertaForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    meta = _metadata(runs[layout])
    s = meta["model_structure"]
    config = RobertaModelSection(**meta["config"]["model"]).resolved(
        vocab_size=s["padded_vocab_size"], padding_idx=s["padding_idx"]
    )
    ours = RobertaModel(config).eval()
    result = ours.load_state_dict(_final_weights(runs[layout]), strict=False)
    assert not result.missing_keys, result
    vocab, pad = s["vocab_size"], s["padding_idx"]
    tokens = torch.randint(5, vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    tokens[:, 0] = 1  # <s>
    tokens[1, 20:] = pad
    mask = tokens.ne(pad).long()
    with torch.no_grad():
        want = ours(tokens, attention_mask=mask)["lm"][..., :vocab]
        got = hf(input_ids=tokens, attention_mask=mask).logits
    diff = (got - want)[mask.bool()].abs().max()
    assert diff <= 1e-4, diff
