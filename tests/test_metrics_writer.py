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
