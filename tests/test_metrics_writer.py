"""metrics.jsonl of a resumed run: what a stopped or killed attempt logged past the checkpoint
is dropped (that run logs those iterations again), so each iteration has one record."""

from __future__ import annotations

import json

from training.metrics import MetricsWriter


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))


def _iterations(path):
    return [json.loads(line)["iteration"] for line in path.read_text().splitlines()]


def test_resume_drops_records_past_the_checkpoint(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    # iterations 1-5, then a line cut short by a kill
    _write(jsonl, [json.dumps({"iteration": i, "lm loss": 1.0 / i}) for i in range(1, 6)])
    with open(jsonl, "a") as fh:
        fh.write('{"iteration": 6, "lm lo')
    writer = MetricsWriter(str(tmp_path), enabled=True, tensorboard=False, resumed_at=3)
    assert _iterations(jsonl) == [1, 2, 3]
    writer.record({"iteration": 4, "lm loss": 0.5})
    writer.close()
    assert _iterations(jsonl) == [1, 2, 3, 4]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_resume_keeps_a_file_with_nothing_past_the_checkpoint(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    _write(jsonl, [json.dumps({"iteration": i}) for i in (1, 2)])
    before = jsonl.stat().st_mtime_ns
    MetricsWriter(str(tmp_path), enabled=True, tensorboard=False, resumed_at=2).close()
    assert _iterations(jsonl) == [1, 2] and jsonl.stat().st_mtime_ns == before


def test_a_run_from_scratch_starts_the_file_afresh(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    _write(jsonl, [json.dumps({"iteration": i}) for i in (1, 2, 3)])
    writer = MetricsWriter(str(tmp_path), enabled=True, tensorboard=False)
    writer.record({"iteration": 1})
    writer.close()
    assert _iterations(jsonl) == [1]


def test_ranks_that_do_not_log_touch_nothing(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    _write(jsonl, [json.dumps({"iteration": i}) for i in (1, 2, 3)])
    MetricsWriter(str(tmp_path), enabled=False, resumed_at=1).close()
    assert _iterations(jsonl) == [1, 2, 3]


def _lines(family_name: str) -> tuple[str, str]:
    """The console's training and validation lines of ``family_name`` for made-up values."""
    from families.base import get_family
    from training.metrics import format_console_line, format_validation_line

    family = get_family(family_name)
    names = tuple(family.metric_names)
    m = {
        "consumed-samples": 8, "iteration-time": 0.5, "samples-per-second": 16.0,
        "throughput": 1.0, "mfu": 0.1, "learning-rate": 1e-3, "batch-size": 8,
        "loss-scale": 1.0, "grad-norm": 1.0, "skipped-iterations": 0, "nan-iterations": 0,
        **dict.fromkeys(names, 2.0),
    }  # fmt: skip
    labels = family.console_labels
    train = format_console_line(4, 10, m, names, family.sample_unit, labels)
    valid = format_validation_line(4, dict.fromkeys(names, 2.0), family.perplexity_metrics, labels)
    return train, valid


def test_each_familys_console_names_say_what_it_computes():
    """GPT: Megatron's "lm loss" and its PPL. RoBERTa: its "lm loss" (the name kept in
    metrics.jsonl and TensorBoard, Megatron's BERT's) is a masked-LM loss, and reads so beside
    "mlm accuracy"; no "lm loss PPL". ViT: loss and accuracy, no perplexity."""
    train, valid = _lines("gpt")
    assert "| lm loss: 2.000000E+00 |" in train
    assert "lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 |" in valid
    train, valid = _lines("roberta")
    assert "| mlm loss: 2.000000E+00 | mlm accuracy: 2.000000E+00 |" in train
    assert "mlm loss value: 2.000000E+00 | mlm PPL: 7.389056E+00 |" in valid
    assert "lm loss" not in train.replace("mlm loss", "")
    assert "lm loss" not in valid.replace("mlm loss", "")
    train, valid = _lines("vit")
    assert "| loss: 2.000000E+00 | accuracy: 2.000000E+00 |" in train
    assert "images/s" in train and "PPL" not in valid
    assert "| loss value: 2.000000E+00 | accuracy value: 2.000000E+00 |" in valid
