"""Export a training checkpoint as a Hugging Face model (GPT-2 style -> ``GPT2LMHeadModel``,
Llama style -> ``LlamaForCausalLM``, RoBERTa -> ``RobertaForMaskedLM``, ViT ->
``ViTForImageClassification``):

    .venv/bin/python tools/export_hf.py \\
        --checkpoint runs/roberta_tiny/checkpoints/iter_0000300 --output exported/roberta_tiny

The checkpoint says its model family; any parallel layout and precision level: the canonical
checkpoint is reassembled (scaled FP16/FP8 weights dequantized) and mapped by the family's
adapter (families/<family>.py). The output directory holds ``config.json`` and
``model.safetensors``; ``from_pretrained`` loads it. A RoBERTa tokenizer stays this project's
SentencePiece model (``data.tokenizer_model`` or the cached stdlib one).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from families import get_family  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="an iter_XXXXXXX directory")
    parser.add_argument("--output", required=True, help="directory to write")
    args = parser.parse_args(argv)
    try:
        meta_path = Path(args.checkpoint) / "metadata.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{args.checkpoint}: no metadata.json (not a checkpoint)")
        family = json.loads(meta_path.read_text()).get("family", "gpt")
        out = get_family(family).export_hf(args.checkpoint, args.output)
    except (FileNotFoundError, ValueError, KeyError, NotImplementedError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
