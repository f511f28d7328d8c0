"""Pack an image-folder tree into one memory-mapped file set for ViT training.

    python tools/preprocess_images.py --input imagenet/train --output-prefix out/imagenet_train
    python tools/preprocess_images.py --input digits_png/ --output-prefix out/digits --channels 1

``--input`` holds one sub-folder per class (sorted names are the class ids) with .png/.jpg/
.jpeg files. Every image is decoded once, converted to RGB (``--channels 3``) or grayscale
(``1``) and stored at its own size in ``PREFIX.bin`` with ``PREFIX.index.npy``,
``PREFIX.labels.npy`` and ``PREFIX.json`` (see ``data/image_data.py``): training then reads
raw pixels instead of decoding, and its items are bit-identical to reading the folder.
Every file's header (a PNG's chunks and CRCs too) is checked before anything is written.
Errors print one line naming the file, exit 2 and leave no output files behind.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.image_data import folder_source, write_packed  # noqa: E402
from data.paths import output_folder  # noqa: E402

__all__ = ["main", "build_parser"]

_PROG = "preprocess_images.py"


class UsageError(Exception):
    """A user mistake reported as one line on stderr with exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="image folder: one sub-folder per class")
    p.add_argument("--output-prefix", required=True, help="output path prefix (PREFIX.bin, ...)")
    p.add_argument(
        "--channels", type=int, choices=(1, 3), default=3, help="3: RGB (default), 1: grayscale"
    )
    return p


def _run(args: argparse.Namespace) -> None:
    if not Path(args.input).exists():
        raise UsageError(f"--input {args.input!r} does not exist")
    source = folder_source(args.input, channels=args.channels)  # ValueError names the culprit
    source.verify(progress=True)  # every file's header before anything is written
    prefix = Path(args.output_prefix)
    # write_packed removes its own files on failure; output_folder the folders made for them.
    with output_folder(prefix.parent):
        meta = write_packed(source, prefix, progress=True)
    print(
        f"output_prefix: {prefix} images: {meta['count']} classes: {len(meta['classes'])} "
        f"channels: {meta['channels']} bytes: {meta['bytes']}"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _run(args)
    except (UsageError, OSError, ValueError) as err:
        print(f"{_PROG}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
