"""Peak host memory of building one rank's model slice, against the slice and the full model.

    .venv/bin/python -m benchmarks.bench_build_memory [--hidden 1024 --layers 8 --vocab 32768]
        [--write docs/BENCHMARKS.md]

Each layout runs in fresh processes (gloo, one per rank), so ``ru_maxrss`` (the process's
peak resident memory) measures this build alone: the figure is the peak minus the resident
memory just before the build, next to the bytes of the slice the rank keeps and of the whole
single-process model. A build that materialised the full model on every rank (as this project
did before slice-wise materialisation) needs at least the full model's bytes; building the
slice by replaying the single-process initialisation one tensor at a time (models/base.py)
needs the slice plus about one full tensor (the largest is the word embedding) and its scratch.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks import bench_docs  # noqa: E402

__all__ = ["LAYOUTS", "measure", "table"]

LAYOUTS = {"single": (1, 1), "TP=2": (2, 1), "PP=2": (1, 2), "TP=2 x PP=2": (2, 2)}
HEADING = "## Building a model slice: peak memory per rank"
MIB = 2**20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; returns the RSS in bytes.
    Without that (old kernels) the lifetime peak is used, which can only overstate."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass
    return _status_kib("VmRSS") * 1024


def _peak_rss() -> int:
    try:
        return _status_kib("VmHWM") * 1024
    except (OSError, RuntimeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _worker(rank: int, world: int, port: int, tp: int, pp: int, shape: dict, out: str):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    from models.context import BuildContext
    from models.gpt import GPTConfig, GPTModel
    from parallel.pipeline import PipelineLayout
    from parallel.topology import init_distributed

    groups, _ = init_distributed(tp, pp, "gloo") if world > 1 else (None, None)
    config = GPTConfig(**shape)
    full = GPTModel(config, BuildContext(device="meta"))
    full_bytes = sum(t.numel() * 4 for t in full.state_dict().values())
    del full
    layout = PipelineLayout(config.num_layers, pp, 1, groups.topology.pp_rank if groups else 0)
    ctx = BuildContext(tp_group=groups.tensor if groups else None)
    torch.manual_seed(0)
    before = _reset_peak()
    model = GPTModel(config, ctx, layout)
    peak = _peak_rss() - before
    slice_bytes = sum(t.nbytes for t in model.state_dict().values())
    result = {"rank": rank, "slice": slice_bytes, "full": full_bytes, "peak": peak}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if groups is not None:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def measure(shape: dict) -> dict[str, list[dict]]:
    """Layout -> one result per rank (bytes of slice, full model, build peak)."""
    from tests.multiproc import free_port

    results = {}
    for name, (tp, pp) in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as out:
            world = tp * pp
            mp.start_processes(
                _worker, args=(world, free_port(), tp, pp, shape, out), nprocs=world,
                start_method="spawn",
            )  # fmt: skip
            results[name] = [
                json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)
            ]
    return results


def table(results: dict[str, list[dict]], shape: dict) -> str:
    h, layers, vocab = shape["hidden_size"], shape["num_layers"], shape["vocab_size"]
    lines = [
        f"GPT, hidden {h}, {layers} layers, vocabulary {vocab}, FP32 (host memory, MiB; "
        "`benchmarks/bench_build_memory.py`). Build peak = peak resident memory during the build "
        "minus the resident memory before it.",
        "",
        "| layout | rank | slice kept | full model | build peak | peak / slice | peak / full |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, ranks in results.items():
        for r in ranks:
            lines.append(
                f"| {name} | {r['rank']} | {r['slice'] / MIB:.0f} | {r['full'] / MIB:.0f} | "
                f"{r['peak'] / MIB:.0f} | {r['peak'] / r['slice']:.2f} | "
                f"{r['peak'] / r['full']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--write", help="markdown file to put the table into")
    args = parser.parse_args()
    shape = dict(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=16,
        seq_length=1024, vocab_size=args.vocab,
    )  # fmt: skip
    body = table(measure(shape), shape)
    print(body)
    if args.write:
        bench_docs.write_section(REPO / args.write, body, "bench_build_memory", HEADING)


if __name__ == "__main__":
    main()
