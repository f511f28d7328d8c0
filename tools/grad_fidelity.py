"""How far each level's gradients are from FP32's, weight by weight, at a checkpoint.

    .venv/bin/python tools/grad_fidelity.py runs/roberta_tiny/checkpoints \\
        --config configs/roberta_tiny.yaml --model roberta --levels O3 O3@block --batches 4

Loads the checkpoint's weights (``checkpoint.finetune``: weights only, in each level's own
storage) into one process at FP32 and at every ``--levels`` entry (``bench_levels``' names:
``O3``, ``te:bf16``, ``O2@block``, ``te@block+e4m3``), runs forward and backward on the same
``--batches`` micro-batches (the ones the run would train on next; from the first sample when
its data is used up), and compares every gradient with FP32's: ``rel`` = ||g - g_fp32|| /
||g_fp32||, ``cos`` = cosine similarity and ``norm`` = ||g|| / ||g_fp32||, averaged over the
batches. No optimizer step runs: every batch sees the checkpoint's weights.

At the checkpoint's own level and granularity the weights are those of FP32: its FP8/FP16
weights are FP32-exact and re-quantise to themselves, so what differs is the arithmetic of the
step alone (the casts of activations and gradients, the FP8 GEMMs, the FP8 gradient slots).
A level that stores or casts its weights otherwise (te or per-tensor O3 from an O3@block
checkpoint) also rounds the weights once more. FP8 scaling state starts fresh (a delayed
recipe casts its first step with current scales, as after a fine-tune's load). Prints one row
per linear weight (``--all``: every parameter), three columns per level, and the whole
model's gradient at the bottom. Any failure prints one ``error:`` line and exits 2.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

import torch  # noqa: E402

from fp8train.precision import split_level  # noqa: E402
from training.config import granularity_overrides  # noqa: E402

__all__ = ["compare", "level_gradients", "main"]

REFERENCE = "fp32"


def level_gradients(
    level: str, config: str, checkpoint: str, overrides: list[str], batches: int, family: str
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """``level``'s losses and gradients (canonical name -> FP32 CPU copy) of the first
    ``batches`` micro-batches after the checkpoint's consumed samples, one process."""
    from data.sampler import micro_batches
    from fp8train.param_state import grad_value
    from training.checkpointer import restore
    from training.config import load_config
    from training.forward_backward import forward_backward
    from training.resume_check import resume_plan
    from training.run_plan import plan_parallel
    from training.setup import build_run
    from training.step import _to_device

    spec, scaling = granularity_overrides(level)
    name, param_dtype = split_level(spec)
    with tempfile.TemporaryDirectory() as scratch:
        cfg = load_config(
            config,
            [
                *overrides,
                f"precision.level={name}",
                f"precision.param_dtype={param_dtype}",
                *scaling,
                f"checkpoint.load={checkpoint}",
                "checkpoint.finetune=true",
                f"checkpoint.dir={scratch}",
                "training.compile=false",
            ],
            family,
        )
        plan = replace(plan_parallel(cfg, 1), resume=resume_plan(cfg))
        state = build_run(cfg, plan)
        restore(state, plan.resume, log=lambda line: None)
    consumed = plan.resume.metadata["consumed_samples"]
    if consumed + batches * cfg.training.micro_batch_size > len(state.train_ds):
        consumed = 0  # the run's last checkpoint: its data is used up, start over
    data = micro_batches(state.train_ds, consumed, cfg.training.micro_batch_size, 0, 1)
    opt, model = state.optimizer, state.model
    losses, grads = [], []
    for _ in range(batches):
        batch = _to_device(next(data), state.device)
        opt.buffers.start_step(1)
        loss_and_tokens = forward_backward(state, [batch])
        opt.buffers.finish()
        totals = loss_and_tokens.double()
        losses.append(float(totals[0] / totals[1]))
        inv = state.scaler.inv_scale
        unscale = 1.0 if inv is None else float(inv)
        named = ((model.canonical_name(n), grad_value(p)) for n, p in model.named_parameters())
        grads.append({k: g.detach().float().cpu() * unscale for k, g in named if g is not None})
        opt.zero_grad()
    return losses, grads


def compare(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> dict:
    """Per name and for all of them together: ``(relative L2 error, cosine similarity, norm
    ratio)`` of ``other`` against ``reference``, in float64."""
    out = {}
    for name, ref in reference.items():
        r, o = ref.double().reshape(-1), other[name].double().reshape(-1)
        out[name] = _pair(r, o)
    r = torch.cat([reference[n].double().reshape(-1) for n in reference])
    o = torch.cat([other[n].double().reshape(-1) for n in reference])
    out["(all)"] = _pair(r, o)
    return out


def _pair(r: torch.Tensor, o: torch.Tensor) -> tuple[float, float, float]:
    norm = float(r.norm())
    rel = float((o - r).norm()) / norm if norm else float("nan")
    denom = norm * float(o.norm())
    cos = float(r @ o) / denom if denom else float("nan")
    return rel, cos, float(o.norm()) / norm if norm else float("nan")


def _table(levels: list[str], results: dict, names: list[str]) -> str:
    head = "| gradient | " + " | ".join(f"{lv} rel | cos | norm" for lv in levels) + " |"
    rule = "|---|" + "---|---|---|" * len(levels)
    rows = [head, rule]
    for name in names:
        cells = []
        for lv in levels:
            rel, cos, ratio = results[lv][name]
            cells += [f"{rel:.4f}", f"{cos:.5f}", f"{ratio:.3f}"]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="an iter_* directory, or a checkpoints directory")
    ap.add_argument("--config", required=True, help="the run's YAML config")
    ap.add_argument("--model", default="gpt", help="model family: gpt, roberta or vit")
    ap.add_argument("--levels", nargs="+", required=True, help="e.g. O3 O3@block te@block+e5m2")
    ap.add_argument("--batches", type=int, default=4, help="micro-batches to average over")
    ap.add_argument("--all", action="store_true", help="every parameter, not only linears")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (the run's own)")
    args = ap.parse_intermixed_args(argv)
    from checkpoint.format import CheckpointError

    try:
        torch.manual_seed(0)
        ref_losses, ref = level_gradients(
            REFERENCE, args.config, args.checkpoint, args.overrides, args.batches, args.model
        )
        results, losses = {}, {REFERENCE: ref_losses}
        for level in args.levels:
            losses[level], grads = level_gradients(
                level, args.config, args.checkpoint, args.overrides, args.batches, args.model
            )
            per_batch = [compare(r, g) for r, g in zip(ref, grads)]
            results[level] = {
                k: tuple(sum(b[k][i] for b in per_batch) / len(per_batch) for i in range(3))
                for k in per_batch[0]
            }
    except (OSError, ValueError, CheckpointError) as err:  # ValueError: ConfigError's base
        print(f"error: {err}", file=sys.stderr)
        return 2
    names = [n for n in ref[0] if args.all or (n.endswith(".weight") and ref[0][n].dim() == 2)]
    linears = [n for n in names if "embedding" not in n] if not args.all else names
    print(f"{args.checkpoint}: {args.batches} micro-batches, gradients against {REFERENCE}")
    print("mean loss: " + ", ".join(f"{k} {sum(v) / len(v):.5f}" for k, v in losses.items()))
    print(_table(args.levels, results, linears + ["(all)"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
