"""Precision audit from the command line: build the configured GPT at each level, take one real
optimizer step on random tokens, and print what every tensor role actually is next to the table.

    .venv/bin/python tools/audit_precision.py --config configs/gpt_tiny.yaml --levels te,O2
    .venv/bin/python tools/audit_precision.py --levels all model.num_layers=2

With several levels it ends with the bytes-per-parameter table (linear weights, one rank)
measured from the live tensors beside the theoretical value. Exits 1 if any role mismatches.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

import torch  # noqa: E402

from fp8train.audit import audit_precision, format_audit  # noqa: E402
from fp8train.convert import apply_level_storage  # noqa: E402
from fp8train.precision import LEVELS, get_recipe  # noqa: E402
from models.context import BuildContext  # noqa: E402
from models.gpt import GPTConfig, GPTModel, pad_vocab_size  # noqa: E402
from training.config import ConfigError, load_config  # noqa: E402
from training.memory import model_state_bytes  # noqa: E402
from training.optimizer import build_optimizer  # noqa: E402

# Model-state bytes per linear-weight parameter at one rank: weight + grad + master + m + v.
THEORY = {"fp32": 16, "bf16": 18, "fp16": 16, "te": 16, "O1": 11, "O2": 6, "O3": 7}


def audit_level(cfg, level: str, steps: int = 1):
    """(audit rows, bytes per param by category) after ``steps`` real steps at ``level``."""
    recipe = get_recipe(level)
    torch.manual_seed(cfg.training.seed)
    vocab = pad_vocab_size(cfg.data.vocab_size, cfg.model.make_vocab_size_divisible_by)
    model = GPTModel(GPTConfig.from_model_section(cfg.model, vocab), BuildContext(recipe))
    apply_level_storage(model, recipe)
    opt = build_optimizer(model, recipe, cfg.optimizer)
    seq = min(cfg.model.seq_length, 64)
    tokens = torch.randint(0, vocab, (2, seq))
    for _ in range(steps):
        autocast = (
            torch.autocast("cpu", dtype=recipe.autocast_dtype)
            if recipe.autocast_dtype
            else contextlib.nullcontext()
        )
        with autocast:
            loss = model(tokens, labels=tokens).float().mean()
        loss.backward()
        opt.step()
    rows = audit_precision(model, opt.optimizer, recipe, master_of=opt.masters)
    return rows, model_state_bytes(model, opt)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/gpt_tiny.yaml")
    parser.add_argument("--levels", default="all", help="comma-separated levels, or 'all'")
    parser.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    args = parser.parse_args(argv)
    levels = list(LEVELS) if args.levels == "all" else args.levels.split(",")
    try:
        cfg = load_config(args.config, args.overrides)
        for level in levels:
            get_recipe(level)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, torch.get_num_threads()))
    summary, failed = [], False
    for level in levels:
        rows, nbytes = audit_level(cfg, level)
        recipe = get_recipe(level)
        print(format_audit(rows, recipe) + "\n")
        failed |= not all(r.ok for r in rows)
        summary.append((level, nbytes))
    if len(summary) > 1:
        print("model-state bytes per parameter, measured at one rank after one step")
        print("| level | linear weights (measured) | theory | all parameters (measured) |")
        print("|---|---|---|---|")
        for level, nbytes in summary:
            print(
                f"| {level} | {nbytes['linear']['total']:.3f} | {THEORY[level]} | "
                f"{nbytes['all']['total']:.3f} |"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
