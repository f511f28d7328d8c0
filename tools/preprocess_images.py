"""Pack an image-folder tree into one memory-mapped file set for ViT training.

    python tools/preprocess_images.py --input imagenet/train --output-prefix out/imagenet_train
    python tools/preprocess_images.py --input digits_png/ --output-prefix out/digits --channels 1

``--input`` holds one sub-folder per class (sorted names are the class ids) with .png/.jpg/
.jpeg files. Every image is decoded once, converted to RGB (``--channels 3``) or grayscale
(``1``) and stored at its own size in ``PREFIX.bin`` with ``PREFIX.index.npy``,
``PREFIX.labels.npy`` and ``PREFIX.json`` (see ``data/image_data.py``): training then reads
raw pixels instead of decoding, and its items are bit-identical to reading the folder.
Errors print one line, exit 2 and leave no output files behind.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.image_data import folder_source, write_packed  # noqa: E402

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


def _make_parents(prefix: Path) -> list[Path]:
    """Create the output folder's missing ancestors; returns them deepest first."""
    created: list[Path] = []
    folder = prefix.parent
    while not folder.exists():
        created.append(folder)
        folder = folder.parent
    for path in reversed(created):
        path.mkdir()
    return created


def _run(args: argparse.Namespace) -> None:
    if not Path(args.input).exists():
        raise UsageError(f"--input {args.input!r} does not exist")
    source = folder_source(args.input, channels=args.channels)  # ValueError names the culprit
    prefix = Path(args.output_prefix)
    created = _make_parents(prefix)
    try:
        meta = write_packed(source, prefix, progress=True)
    except BaseException:
        for folder in created:  # "nothing left behind" includes folders made for the output
            if not any(folder.iterdir()):
                folder.rmdir()
        raise
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
