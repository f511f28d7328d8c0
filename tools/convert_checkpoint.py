"""Convert checkpoints: reshard to any parallel layout, import or export Hugging Face models.

    # any layout -> TP=1 PP=1 (or any other), at the checkpoint's precision level
    .venv/bin/python tools/convert_checkpoint.py --input runs/gpt_tiny/checkpoints \\
        --output converted/tp1 --format native --tensor 1 --pipeline 1
    # Hugging Face GPT-2 / Llama / RoBERTa / ViT directory -> native, TP=2 x PP=2
    .venv/bin/python tools/convert_checkpoint.py --input hf/llama --output ckpt/llama \\
        --format native --tensor 2 --pipeline 2
    # native -> Hugging Face (config.json + model.safetensors)
    .venv/bin/python tools/convert_checkpoint.py --input runs/gpt_tiny/checkpoints \\
        --output exported/gpt_tiny --format hf

The input's kind is detected: a Hugging Face directory (config.json + safetensors), a
checkpoint (``iter_*`` with metadata.json) or a checkpoints directory (its ``latest``). Native
output is a checkpoints directory (``iter_*`` + ``latest``) that ``checkpoint.load`` (and a run
with ``checkpoint.dir`` pointing at it) reads; one imported from Hugging Face holds weights
only and starts a run with ``checkpoint.finetune=true``. A run may also simply load a
checkpoint of another layout: it reshards on load by the same code. Progress goes to stderr,
one line per tensor. Every input file is checked (headers, sizes, JSON) before anything is
written: a missing, truncated or garbled one is one ``error:`` line naming it, exit 2; nothing is
left at ``--output`` on any failure (an existing non-empty output is refused).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# megatron-core (the scheduler, imported with training/) warns that TE/apex are absent.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

from checkpoint.store import CheckpointError  # noqa: E402
from training.config import ConfigError  # noqa: E402
from training.conversion import Layout, convert_native, detect_kind, export_hf, import_hf  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="checkpoint, checkpoints dir or HF directory")
    p.add_argument("--output", required=True, help="directory to write (must not exist yet)")
    p.add_argument("--format", required=True, choices=("native", "hf"), help="output format")
    p.add_argument("--tensor", type=int, help="tensor-parallel size (native; default: the input's)")
    p.add_argument("--pipeline", type=int, help="pipeline stages (native; default: the input's)")
    p.add_argument("--virtual-pipeline", type=int, help="model chunks per pipeline stage")
    p.add_argument("--data-parallel", type=int, help="data-parallel size the run will have")
    p.add_argument(
        "--distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        help="shard optimizer state over the data-parallel ranks (default: as the input)",
    )
    p.add_argument(
        "--make-vocab-size-divisible-by", type=int, default=128,
        help="vocabulary padding of a Hugging Face import (default 128)",
    )  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no per-tensor progress lines")
    return p


def _layout(args, saved: dict | None) -> Layout:
    """The requested layout; sizes not given keep the input's (1 for a Hugging Face input)."""
    from checkpoint.reshard import layout_of

    base = layout_of(saved) if saved else {}

    def pick(value, key, default=1):
        return value if value is not None else base.get(key, default)

    return Layout(
        tensor=pick(args.tensor, "tensor"),
        pipeline=pick(args.pipeline, "pipeline"),
        virtual_pipeline=pick(args.virtual_pipeline, "virtual_pipeline"),
        data=pick(args.data_parallel, "data"),
        distributed=pick(args.distributed_optimizer, "distributed", False),
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    progress = (lambda _line: None) if args.quiet else None
    try:
        kind = detect_kind(args.input)
        if args.format == "hf":
            if kind == "hf":
                raise ValueError(f"--input {args.input} is already a Hugging Face directory")
            out = export_hf(args.input, args.output)
            print(f"wrote Hugging Face model {out}")
            return 0
        extra = {"progress": progress} if progress else {}
        if kind == "hf":
            layout = _layout(args, None)
            out = import_hf(
                args.input, args.output, layout, args.make_vocab_size_divisible_by, **extra
            )
        else:
            from checkpoint.store import read_metadata, resolve_checkpoint

            saved = read_metadata(resolve_checkpoint(args.input))
            layout = _layout(args, saved)
            out = convert_native(args.input, args.output, layout, **extra)
    except (CheckpointError, ConfigError, OSError, ValueError, KeyError, NotImplementedError) as e:
        # Damaged input is refused before --output is made; a later failure removes it again.
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {out} (TP={layout.tensor} PP={layout.pipeline} virtual={layout.virtual_pipeline}"
        f" DP={layout.data}{' distributed optimizer' if layout.distributed else ''})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
