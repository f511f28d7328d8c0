"""Activation memory per transformer layer: bytes saved for backward, with and without sequence
parallelism and activation recompute, plus the bytes each TP collective puts on the wire.

    python -m benchmarks.bench_activations [--tp 2] [--level te] [--seq 256] [--hidden 256]

Spawns ``--tp`` gloo ranks on this machine (CPU). "Saved bytes" are what autograd keeps for
backward during one layer's forward (counted with saved_tensors_hooks, unique storages), on
rank 0, per layer; a printed table per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _saved_bytes(fn) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.float().sum().backward()
    return sum(seen.values())


def _worker(rank, world, init_file, out_file, args):
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
            timeout=timedelta(seconds=120),
        )  # fmt: skip
    from fp8train.precision import get_recipe
    from models.context import BuildContext
    from models.gpt import GPTConfig, GPTModel
    from parallel.comm_meter import CommMeter

    group = dist.group.WORLD if world > 1 else None
    rows = []
    for sp in (False, True) if world > 1 else (False,):
        for recompute in ("none", "selective", "full"):
            cfg = GPTConfig(
                num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads,
                seq_length=args.seq, vocab_size=512, hidden_dropout=0.0,
                attention_dropout=0.0, recompute=recompute,
            )  # fmt: skip
            torch.manual_seed(0)
            model = GPTModel(
                cfg, BuildContext(get_recipe(args.level), tp_group=group, sequence_parallel=sp)
            )
            layer = model.layers[0]
            meter = CommMeter()
            for m in layer.modules():
                if hasattr(m, "meter"):
                    m.meter = meter
            s = args.seq // world if sp else args.seq
            x = torch.randn(args.batch, s, args.hidden, requires_grad=True)
            meter.reset_step()
            saved = _saved_bytes(lambda layer=layer, x=x: layer(x))
            elements = args.batch * args.seq * args.hidden
            comm = {k: v / elements for k, v in meter.step_summary().items()}
            rows.append({"sp": sp, "recompute": recompute, "saved": saved, "comm": comm})
    if rank == 0:
        Path(out_file).write_text(json.dumps(rows))
    if world > 1:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--level", default="te")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        mp.spawn(_worker, args=(args.tp, str(Path(tmp) / "init"), str(out), args), nprocs=args.tp)
        rows = json.loads(out.read_text())
    print(
        f"one transformer layer, level {args.level}, tp {args.tp}, batch {args.batch}, "
        f"seq {args.seq}, hidden {args.hidden}; rank 0"
    )
    print(
        "| sequence parallel | recompute | saved for backward (MiB) | vs no SP, no recompute "
        "| TP bytes on the wire per activation element (fwd+bwd) |"
    )
    print("|---|---|---|---|---|")
    base = rows[0]["saved"]
    for r in rows:
        comm = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["comm"].items())) or "-"
        print(
            f"| {r['sp']} | {r['recompute']} | {r['saved'] / 2**20:.2f} | "
            f"{r['saved'] / base:.2f}x | {comm} |"
        )


if __name__ == "__main__":
    main()
