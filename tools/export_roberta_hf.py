"""Export a RoBERTa training checkpoint as a Hugging Face ``RobertaForMaskedLM``:

    .venv/bin/python tools/export_roberta_hf.py \\
        --checkpoint runs/roberta_tiny/checkpoints/iter_0000300 --output exported/roberta_tiny

Any parallel layout and precision level: the canonical checkpoint is reassembled (scaled
FP16/FP8 weights dequantized) and mapped by the family's adapter (families/roberta.py). The
output directory holds ``config.json`` and ``model.safetensors``; ``from_pretrained`` loads it.
The tokenizer is this project's SentencePiece model (``data.tokenizer_model`` or the cached
stdlib one), not a Hugging Face tokenizer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from families.roberta import export_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="an iter_XXXXXXX directory")
    parser.add_argument("--output", required=True, help="directory to write")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.output)
    except (FileNotFoundError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
