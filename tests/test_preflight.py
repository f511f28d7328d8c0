"""Pre-flight (training/preflight.py): what the config and the world size reveal is refused
before any worker joins a process group, in one line naming the key or file, exit 2, nothing
written; under plain torchrun (every worker stops on its own) and under training.launcher
(no worker starts at all).

The checks themselves are tested in-process (milliseconds each); plain torchrun runs the
cases the issue names, several jobs at once to keep the file short on two cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO, tiny_overrides
from multiproc import TORCHRUN, _hidden_gpus

from checkpoint.store import CheckpointError
from data.indexed import check_index_header
from data.paths import directory_problem
from tools.preprocess_data import main as preprocess_main
from training.config import ConfigError, load_config
from training.preflight import PREFLIGHT_ERRORS, preflight

CONFIG = "configs/gpt_tiny.yaml"
ERROR_FILE_LINE = "  traceback : "  # where torchrun's failure report shows a worker's error file


def _overrides(data, run_dir: Path, **extra) -> list[str]:
    values = {"training.train_iters": 1, "training.eval_iters": 0, "optimizer.lr_warmup_iters": 0}
    values.update(extra)
    return tiny_overrides(data, run_dir, "fp32", **values)


def _refusal(overrides: list[str], world: int = 1) -> str:
    """The pre-flight's message for a run of ``overrides`` on ``world`` ranks."""
    with pytest.raises(PREFLIGHT_ERRORS) as caught:
        preflight(load_config(CONFIG, overrides), world)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.fixture(scope="module")
def checkpoints(tiny_data, tmp_path_factory):
    """A real one-step checkpoint (one process, fp32) and damaged copies of it:
    ``{"good", "roberta", "missing_file", "bad_header"}`` -> checkpoint directory."""
    from training.loop import pretrain

    root = tmp_path_factory.mktemp("preflight_ckpt")
    pretrain(load_config(CONFIG, _overrides(tiny_data, root / "source")))
    good = root / "source" / "checkpoints" / "iter_0000001"
    out = {"good": good}
    for name in ("roberta", "missing_file", "bad_header"):
        shutil.copytree(good, root / name)
        out[name] = root / name
    meta = json.loads((good / "metadata.json").read_text())
    (out["roberta"] / "metadata.json").write_text(json.dumps({**meta, "family": "roberta"}))
    (out["missing_file"] / "model.safetensors").unlink()
    (out["bad_header"] / "optimizer.safetensors").write_bytes(
        b"\x08\x00\x00\x00\x00\x00\x00\x00{bad}"
    )
    return out


@pytest.fixture(scope="module")
def bad_data(tiny_data, tmp_path_factory):
    """Damaged copies of the tiny corpus and its tokenizer."""
    root = tmp_path_factory.mktemp("preflight_data")
    prefix = Path(tiny_data.data_prefix)
    truncated = root / "truncated_text_document"
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{prefix}{suffix}", f"{truncated}{suffix}")
    with open(f"{truncated}.bin", "r+b") as fh:
        fh.truncate(os.path.getsize(f"{truncated}.bin") - 2)
    not_index = root / "text_text_document"
    Path(f"{not_index}.bin").write_bytes(b"")
    Path(f"{not_index}.idx").write_text("not an index\n" * 10)
    corrupt = root / "corrupt.model"
    corrupt.write_bytes(b"this is not a SentencePiece model" * 10)
    afile = root / "a_file"
    afile.write_text("a regular file\n")
    # A user's own small corpus: 20 JSONL documents, tokenized as tools/preprocess_data.py
    # does it (too few for the default split's 2% validation set).
    jsonl = root / "small.jsonl"
    texts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(20)]
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    argv = ["--input", jsonl, "--tokenizer-model", tiny_data.tokenizer_model,
            "--output-prefix", root / "small"]  # fmt: skip
    assert preprocess_main([str(a) for a in argv]) == 0
    return {"truncated": truncated, "not_index": not_index, "corrupt": corrupt, "file": afile,
            "small": root / "small_text_document"}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The checks, in-process.


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("missing_data", "data.data_prefix: indexed dataset file not found"),
        ("truncated_bin", "data.data_prefix: "),
        ("not_an_index", "is not a Megatron MMIDIDX index file"),
        ("missing_tokenizer", "data.tokenizer_model: tokenizer model not found"),
        ("corrupt_tokenizer", "data.tokenizer_model: tokenizer model"),
        ("logging_dir_under_a_file", "config: logging.dir="),
        ("checkpoint_dir_under_a_file", "config: checkpoint.dir="),
        ("cache_dir_under_a_file", "config: data.cache_dir="),
        ("indivisible_batch", "training.global_batch_size=4 is not divisible"),
        ("tensor_beyond_world", "parallel.tensor"),
    ],
)
def test_preflight_names_the_culprit(tiny_data, bad_data, tmp_path, case, needle):
    run_dir = tmp_path / "run"
    under_file = str(bad_data["file"] / "sub")
    extra, world = {
        "missing_data": ({"data.data_prefix": str(tmp_path / "nothing_text_document")}, 1),
        "truncated_bin": ({"data.data_prefix": str(bad_data["truncated"])}, 1),
        "not_an_index": ({"data.data_prefix": str(bad_data["not_index"])}, 1),
        "missing_tokenizer": ({"data.tokenizer_model": str(tmp_path / "none.model")}, 1),
        "corrupt_tokenizer": ({"data.tokenizer_model": str(bad_data["corrupt"])}, 1),
        "logging_dir_under_a_file": ({"logging.dir": under_file}, 1),
        "checkpoint_dir_under_a_file": ({"checkpoint.dir": under_file}, 1),
        "cache_dir_under_a_file": ({"data.cache_dir": under_file}, 1),
        "indivisible_batch": ({}, 3),  # 4 samples, micro-batch 2, 3 replicas
        "tensor_beyond_world": ({"parallel.tensor": 2}, 1),
    }[case]
    message = _refusal(_overrides(tiny_data, run_dir, **extra), world)
    assert needle in message, message
    if case == "truncated_bin":
        assert "holds" in message and "its index describes" in message, message
    if "under_a_file" in case:
        assert message.endswith(f"{bad_data['file']} is not a directory"), message
    assert not run_dir.exists()


def test_a_split_that_leaves_a_set_without_documents_is_refused(tiny_data, bad_data, tmp_path):
    """20 documents and the default 98,2,0: the validation set would get none, which
    megatron-core found after every worker had started (a traceback per rank). Refused
    here, naming data.split and a split that fits, which then passes."""
    small = {"data.data_prefix": str(bad_data["small"])}
    overrides = _overrides(tiny_data, tmp_path / "run", **small)
    assert load_config(CONFIG, overrides).data.split == "98,2,0"
    assert _refusal(overrides) == (
        "config: data.split='98,2,0' gives the valid set none of the dataset's 20 documents; "
        "one that fits: data.split=19,1,0"
    )
    preflight(load_config(CONFIG, [*overrides, "data.split=19,1,0"]), 1)
    message = _refusal([*overrides, "data.split=94,5,1"])  # 19, 1, 0 documents
    assert message.startswith("config: data.split='94,5,1' gives the test set none"), message
    assert message.endswith("data.split=18,1,1"), message
    assert not (tmp_path / "run").exists()


def test_nccl_without_cuda_is_refused(tiny_data, tmp_path, monkeypatch):
    """Before any worker: under torchrun the worker that found it first made the agent end
    the others (exit 1, "exited with code -15")."""
    from fp8train import device

    monkeypatch.setattr(device, "is_cuda", lambda: False)
    overrides = _overrides(tiny_data, tmp_path / "run", **{"parallel.backend": "nccl"})
    message = _refusal(overrides, world=2)
    assert message.startswith("config: parallel.backend=nccl needs CUDA"), message
    assert "set parallel.backend=gloo" in message
    preflight(load_config(CONFIG, [*overrides, "parallel.backend=gloo"]), 2)


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("roberta", "holds a 'roberta' model; this run trains 'gpt'"),
        ("missing_file", "checkpoint file missing: "),
        ("bad_header", "cannot read checkpoint file "),
        ("other_model", "model.hidden_size=32 but checkpoint"),
        ("other_level", "precision.level=bf16 but checkpoint"),
        ("not_a_checkpoint", "not a checkpoint (no metadata.json)"),
    ],
)
def test_a_checkpoint_that_cannot_be_resumed_is_refused(
    tiny_data, checkpoints, tmp_path, case, needle
):
    extra = {"checkpoint.load": str(checkpoints.get(case, checkpoints["good"]))}
    if case == "other_model":
        extra["model.hidden_size"] = 32
    elif case == "other_level":
        extra["precision.level"] = "bf16"
    elif case == "not_a_checkpoint":
        extra["checkpoint.load"] = str(tmp_path)
    overrides = _overrides(tiny_data, tmp_path / "run", **extra)
    message = _refusal(overrides, world=2)
    assert needle in message, message
    assert not (tmp_path / "run").exists()


def test_another_layout_or_a_finetune_is_not_refused(tiny_data, checkpoints, tmp_path):
    """The checkpoint of one process (TP=1 DP=1) reshards to DP=2, TP=2 and TP=2 x DP=2; a
    fine-tune takes its weights at another level; its own run directory resumes it."""
    load = {"checkpoint.load": str(checkpoints["good"])}
    for world, extra in ((2, {}), (2, {"parallel.tensor": 2}), (4, {"parallel.tensor": 2})):
        preflight(
            load_config(CONFIG, _overrides(tiny_data, tmp_path / "a", **load, **extra)), world
        )
    finetune = {"checkpoint.finetune": True, "precision.level": "bf16"}
    preflight(load_config(CONFIG, _overrides(tiny_data, tmp_path / "b", **load, **finetune)), 1)
    own = _overrides(tiny_data, checkpoints["good"].parent.parent)  # the source run itself
    preflight(load_config(CONFIG, own), 2)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_plan_it_hands_to_the_build(tiny_data, checkpoints, tmp_path):
    """What the pre-flight worked out is what the run uses: the split, micro-batches per step,
    chunks per stage, the logging rank and the checkpoint (its metadata, read once)."""
    pipelined = {
        "parallel.tensor": 2, "parallel.pipeline": 2, "parallel.virtual_pipeline": 2,
        "model.num_layers": 4, "training.global_batch_size": 16,
    }  # fmt: skip
    cfg = load_config(CONFIG, _overrides(tiny_data, tmp_path / "a", **pipelined))
    plan = preflight(cfg, 8)
    micro = 16 // (cfg.training.micro_batch_size * 2)  # 2 data-parallel ranks
    assert (plan.world_size, plan.tensor, plan.pipeline, plan.data) == (8, 2, 2, 2)
    assert (plan.virtual_stages, plan.micro_batches) == (2, micro)
    assert plan.logging_rank == 7 and plan.resume is None
    assert preflight(cfg, None) is None  # world size not known yet: checks only
    own = load_config(CONFIG, _overrides(tiny_data, checkpoints["good"].parent.parent))
    resume = preflight(own, 1).resume
    assert resume.path == checkpoints["good"] and not resume.weights_only
    saved = json.loads((checkpoints["good"] / "metadata.json").read_text())
    assert resume.iteration == saved["iteration"] == 1
    assert resume.gemm_backend == saved["fp8_gemm_backend"]
    assert resume.saved_structure == saved["model_structure"]
    finetune = {"checkpoint.load": str(checkpoints["good"]), "checkpoint.finetune": True}
    resume = preflight(load_config(CONFIG, _overrides(tiny_data, tmp_path / "b", **finetune)), 1)
    assert resume.resume.weights_only and resume.resume.saved_structure is None


def test_the_build_refuses_a_plan_for_another_world_size(tiny_data, tmp_path):
    from training.setup import build_run

    cfg = load_config(CONFIG, _overrides(tiny_data, tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"^config: planned for 2 ranks, but WORLD_SIZE=1$"):
        build_run(cfg, preflight(cfg, 2))


def test_the_default_corpus_still_to_be_built_is_no_error(tmp_path):
    """An empty data.cache_dir: the corpus is built when the run starts; nothing is written
    now. Its cache directory must be creatable, though."""
    cache = tmp_path / "cache"
    overrides = [f"logging.dir={tmp_path / 'run'}", f"data.cache_dir={cache}"]
    preflight(load_config(CONFIG, overrides), 2)
    assert not cache.exists() and not (tmp_path / "run").exists()
    (tmp_path / "file").write_text("")
    overrides[1] = f"data.cache_dir={tmp_path / 'file' / 'cache'}"
    with pytest.raises(ConfigError, match=r"data\.cache_dir=.* is not a directory"):
        preflight(load_config(CONFIG, overrides), 2)


def test_directory_problem(tmp_path):
    assert directory_problem(tmp_path) is None
    assert directory_problem(tmp_path / "a" / "b" / "c") is None  # mkdir -p would make it
    (tmp_path / "f").write_text("")
    assert directory_problem(tmp_path / "f") == f"{tmp_path / 'f'} exists and is not a directory"
    assert directory_problem(tmp_path / "f" / "x") == f"{tmp_path / 'f'} is not a directory"
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert directory_problem(tmp_path / "dangling" / "x").endswith("is a broken symbolic link")
    assert not list(tmp_path.glob("a"))  # nothing was created


def test_index_header_check_reads_no_data(tiny_data, bad_data):
    stats = check_index_header(tiny_data.data_prefix)
    assert (stats.num_documents, stats.num_tokens) == (
        tiny_data.num_documents,
        tiny_data.num_tokens,
    )
    with pytest.raises(ValueError, match="truncated or not the index's data file"):
        check_index_header(bad_data["truncated"])
    with pytest.raises(ValueError, match="is not a Megatron MMIDIDX index file"):
        check_index_header(bad_data["not_index"])


def test_a_damaged_checkpoint_error_is_a_checkpoint_error(tiny_data, checkpoints, tmp_path):
    """The refusal types the entry point turns into exit 2 (not a traceback)."""
    overrides = _overrides(
        tiny_data, tmp_path, **{"checkpoint.load": str(checkpoints["missing_file"])}
    )
    with pytest.raises(CheckpointError):
        preflight(load_config(CONFIG, overrides), 1)


@pytest.fixture
def sigterm_restored():
    """The entry point ignores SIGTERM once it has failed under torchrun; this process's own
    handler comes back after the test."""
    saved = signal.getsignal(signal.SIGTERM)
    yield saved
    signal.signal(signal.SIGTERM, saved)


def test_the_first_worker_to_fail_on_a_node_prints_the_line(
    tmp_path, monkeypatch, capsys, sigterm_restored
):
    """Under torchrun the agent SIGTERMs the other workers once one has exited, so local rank
    0 may be ended before it prints: the first worker to fail prints instead (a marker in the
    directory torchrun makes for this start of the node's workers, fresh at a restart). Each
    worker still writes its own error file. Without that layout, local rank 0 prints.
    The workers run ``main`` one after another here: the order they fail in is chosen, not
    raced."""
    from training.entry_point import main

    args = ["--config", CONFIG, f"logging.dir={tmp_path / 'run'}"]
    needle = TORCHRUN_CASES["indivisible_batch"][1]  # the shipped batch on 3 ranks
    for key in ("TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "3")
    run_log_dir = tmp_path / "torchelastic_x" / "none_abc"  # DefaultLogsSpecs' layout

    def worker(local_rank: int | None, attempt: int | None = None) -> str:
        """This worker's stderr; ``attempt`` None: not under torchrun."""
        for key in ("RANK", "LOCAL_RANK"):
            if local_rank is None:
                monkeypatch.delenv(key, raising=False)
            else:
                monkeypatch.setenv(key, str(local_rank))
        error_file = None
        if attempt is not None:
            error_file = run_log_dir / f"attempt_{attempt}" / str(local_rank) / "error.json"
            error_file.parent.mkdir(parents=True)
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        assert main("gpt", args) == 2
        err = capsys.readouterr().err
        if error_file is not None:
            message = json.loads(error_file.read_text())["message"]["message"]
            assert message.startswith("error: ") and needle in message, message
        return err

    line = worker(1, attempt=0)  # local rank 1 fails first: it prints, not local rank 0
    assert line.startswith("error: ") and needle in line and line.count("\n") == 1, line
    assert worker(0, attempt=0) == "" and worker(2, attempt=0) == ""
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # the agent's cannot cut it
    assert worker(2, attempt=1) == line  # a restart: its first worker to fail prints again
    assert worker(0, attempt=1) == "" and worker(1, attempt=1) == ""

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    signal.signal(signal.SIGTERM, sigterm_restored)
    assert worker(1) == ""  # not under torchrun: local rank 0 prints
    assert worker(0) == line
    assert worker(None) == line  # a single process
    assert signal.getsignal(signal.SIGTERM) == sigterm_restored  # left alone outside torchrun

    # Another layout of the error file (a custom --logs_specs), or no marker can be made
    # (here: no attempt directory): the fixed rank's rule.
    from training.entry_point import _first_to_fail

    custom = tmp_path / "logs" / "1" / "error.json"
    missing = tmp_path / "gone" / "attempt_0" / "1" / "error.json"
    for error_file in (custom, missing):
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        assert _first_to_fail(True) and not _first_to_fail(False)
    assert not (tmp_path / "logs").exists() and not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# Through plain torchrun: every worker stops before the process group, the first worker to
# fail on the node says why once (the agent may end the others before they print),
# torchrun's failure report names that line as the root cause.

# One case per kind of check (the data, the checkpoint to resume, the layout for the world
# size): every check's own message is tested in one process above, and the workers reach each
# through the same pre-flight, so more cases here would add interpreters, not coverage.
TORCHRUN_CASES = {
    "missing_data": (2, "data.data_prefix: indexed dataset file not found"),
    "checkpoint_of_another_family": (2, "holds a 'roberta' model"),
    "indivisible_batch": (3, "not divisible by training.micro_batch_size=4 x data-parallel size 3"),
}


# Through the launcher only: the pre-flight's other checks reach workers the same way.
LAUNCHER_CASES = {
    **TORCHRUN_CASES,
    # 2 ranks: the GPUs hidden (_run), so nccl has no CUDA on any machine.
    "nccl_without_cuda": (2, "parallel.backend=nccl needs CUDA"),
    "small_corpus": (2, "data.split='98,2,0' gives the valid set none"),
}


def _case_args(case: str, data, bad_data, checkpoints, run_dir: Path) -> list[str]:
    if case == "indivisible_batch":  # the shipped config's batch (8 = 4 x 2) on 3 ranks
        return [f"logging.dir={run_dir}"]
    if case == "nccl_without_cuda":
        return [f"logging.dir={run_dir}", "parallel.backend=nccl"]
    if case == "small_corpus":
        return _overrides(data, run_dir, **{"data.data_prefix": str(bad_data["small"])})
    extra = {
        "missing_data": {"data.data_prefix": str(run_dir.parent / "nothing_text_document")},
        "checkpoint_of_another_family": {"checkpoint.load": str(checkpoints["roberta"])},
    }[case]
    return _overrides(data, run_dir, **extra)


def _run(
    cmd: list[str], nproc: int, timeout: float = 300
) -> tuple[subprocess.CompletedProcess, float]:
    # On the CPU (gloo) as tests/multiproc.py starts ranks: on a one-GPU machine rank 1 would
    # otherwise ask for cuda:1.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **_hidden_gpus(nproc))
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


@pytest.fixture(scope="module")
def torchrun_results(tiny_data, bad_data, checkpoints, tmp_path_factory):
    """Every case under plain torchrun, three jobs at a time: case -> (process, seconds,
    run directory)."""
    root = tmp_path_factory.mktemp("preflight_torchrun")

    def one(case: str):
        nproc = TORCHRUN_CASES[case][0]
        run_dir = root / case / "run"
        run_dir.parent.mkdir()
        args = _case_args(case, tiny_data, bad_data, checkpoints, run_dir)
        cmd = [*TORCHRUN, "--nproc_per_node", str(nproc), "pretrain_gpt.py", "--config", CONFIG]
        return case, (*_run([*cmd, *args], nproc), run_dir)

    with ThreadPoolExecutor(3) as pool:
        return dict(pool.map(one, TORCHRUN_CASES))


@pytest.mark.parametrize("case", list(TORCHRUN_CASES))
def test_plain_torchrun_stops_every_worker_with_one_line(torchrun_results, case):
    proc, seconds, run_dir = torchrun_results[case]
    nproc, needle = TORCHRUN_CASES[case]
    ours = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert proc.returncode != 0 and len(ours) == 1 and needle in ours[0], proc.stderr[-3000:]
    # Every worker exited 2 (ours) or, when another stopped first, was ended by the agent's
    # SIGTERM (it terminates the others once one has exited) before it had failed too: one
    # that has ignores it, so the first to fail prints its line; the root cause is our line,
    # not "To enable traceback see ...".
    codes = re.findall(r"exitcode  : (-?\d+) ", proc.stderr)
    assert len(codes) == nproc and set(codes) <= {"2", "-15"}, proc.stderr[-3000:]
    root_cause = proc.stderr.split("Root Cause", 1)[1]
    assert "exitcode  : 2 " in root_cause, proc.stderr[-3000:]
    assert ERROR_FILE_LINE + ours[0] in root_cause, proc.stderr[-3000:]
    assert "To enable traceback" not in proc.stderr
    assert not run_dir.exists()  # no metrics, TensorBoard file or checkpoint
    lines = len(proc.stderr.splitlines()) + len(proc.stdout.splitlines())
    print(f"\n{case}: exit {proc.returncode}, {lines} lines, {seconds:.1f} s: {ours[0]}")


# ---------------------------------------------------------------------------------------------
# Through training.launcher (what make train runs): one line, and no worker started.


@pytest.mark.parametrize(
    "case",
    ["indivisible_batch", "checkpoint_of_another_family", "nccl_without_cuda", "small_corpus"],
)
def test_the_launcher_prints_one_line_and_starts_no_worker(
    tiny_data, bad_data, checkpoints, tmp_path, case
):
    nproc, needle = LAUNCHER_CASES[case]
    run_dir = tmp_path / "run"
    logs = tmp_path / "torchrun_logs"  # torchrun fills it once it starts workers
    cmd = [sys.executable, "-m", "training.launcher", "--standalone", "--log-dir", str(logs),
           "--nproc_per_node", str(nproc), "pretrain_gpt.py", "--config", CONFIG]  # fmt: skip
    proc, seconds = _run(
        [*cmd, *_case_args(case, tiny_data, bad_data, checkpoints, run_dir)], nproc
    )
    lines = [x for x in proc.stderr.splitlines() + proc.stdout.splitlines() if x.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert not logs.exists() and not run_dir.exists()
    print(f"\nlauncher {case}: {seconds:.1f} s: {lines[0]}")
