"""A checkpoint written before the checkpoint package existed still resumes.

tests/fixtures/checkpoint_a2af7ee/ holds iteration 2 of a 4-step fp32 run of a very small GPT
(hidden 16), written by fp8train at commit a2af7ee with its ``make_fixture.py`` (run from a
checkout of that commit), and the losses that run logged at steps 3 and 4. Resuming it with
today's code on the same data must continue that run: steps 3 and 4 logged (resumed, not
restarted), and their losses the old run's to FP32 rounding (1e-5 relative: another CPU sums
in other orders). The same data: the tests' tiny corpus is built from this Python's standard
library, so where its bytes differ from the fixture's (another Python version) only the resume
itself is checked.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from conftest import REPO, tiny_overrides

from training.config import load_config
from training.loop import pretrain

FIXTURE = REPO / "tests" / "fixtures" / "checkpoint_a2af7ee"


def _sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_a_checkpoint_of_a2af7ee_resumes(tiny_data, tmp_path):
    expected = json.loads((FIXTURE / "expected.json").read_text())
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(FIXTURE, checkpoints, ignore=shutil.ignore_patterns("*.json", "*.py"))
    shutil.copy(FIXTURE / "iter_0000002" / "metadata.json", checkpoints / "iter_0000002")
    overrides = tiny_overrides(
        tiny_data, tmp_path, "fp32",
        **{"model.hidden_size": 16, "model.seq_length": 32, "training.train_iters": 4,
           "training.eval_interval": 1000, "training.eval_iters": 0,
           "optimizer.lr_warmup_iters": 1, "checkpoint.save_interval": 2,
           "checkpoint.dir": str(checkpoints), "logging.tensorboard": "false"},
    )  # fmt: skip
    summary = pretrain(load_config(str(REPO / "configs/gpt_tiny.yaml"), overrides))
    assert summary["iteration"] == 4
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [3, 4]  # resumed at 2, not started over
    assert (checkpoints / "latest").read_text().strip() == "iter_0000004"
    same_data = (
        _sha256(tiny_data.data_prefix + ".bin") == expected["data_sha256"]
        and _sha256(tiny_data.tokenizer_model) == expected["tokenizer_sha256"]
    )
    if same_data:
        for record in records:
            old = expected["losses"][str(record["iteration"])]
            assert abs(record["lm loss"] - old) <= 1e-5 * old, (record, old)
