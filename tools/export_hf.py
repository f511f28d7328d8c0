"""Export a training checkpoint as a Hugging Face model (GPT-2 style -> ``GPT2LMHeadModel``,
Llama style -> ``LlamaForCausalLM``, RoBERTa -> ``RobertaForMaskedLM``, ViT ->
``ViTForImageClassification``):

    .venv/bin/python tools/export_hf.py \\
        --checkpoint runs/roberta_tiny/checkpoints/iter_0000300 --output exported/roberta_tiny

The checkpoint says its model family; any parallel layout and precision level: the canonical
checkpoint is reassembled (scaled FP16/FP8 weights dequantized) and mapped by the family's
adapter (families/<family>.py). The output directory holds ``config.json``,
``model.safetensors`` and the run's tokenizer (training/tokenizer_files.py: a SentencePiece
model becomes a ``LlamaTokenizer`` checked to give this project's ids), or for ViT the image
processor (``preprocessor_config.json``: the run's evaluation view and normalisation);
``from_pretrained`` and ``AutoTokenizer.from_pretrained`` (``AutoImageProcessor``) load it.
One line on stderr says which was written, or why none was. The same as
``tools/convert_checkpoint.py --format hf``: a damaged checkpoint file is one ``error:`` line
naming it, exit 2, and nothing is left at ``--output``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# megatron-core warns at import that TE/apex are absent; we use neither on purpose.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

from checkpoint.store import CheckpointError  # noqa: E402
from training.conversion import export_hf  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint", required=True, help="an iter_XXXXXXX directory or a checkpoints directory"
    )
    parser.add_argument("--output", required=True, help="directory to write")
    args = parser.parse_args(argv)
    try:
        out = export_hf(args.checkpoint, args.output)
    except (OSError, ValueError, KeyError, NotImplementedError, CheckpointError) as err:
        # Damaged input is refused before --output is made; a later failure removes it again.
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
