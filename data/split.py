"""How ``data.split`` cuts a text corpus into train, valid and test documents, in plain Python.

The arithmetic is megatron-core's (``parse_and_normalize_split`` then
``convert_split_vector_to_split_matrix``, rounded per bookend as ``split_document_ranges`` in
data/gpt_data.py does; tests/test_data_gpt.py compares the two), without importing
megatron-core, which costs seconds: the pre-flight checks a split against the dataset's
document count before any worker starts (``split_problem``), and says what would fit.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PART_NAMES", "document_ranges", "fitting_split", "split_problem"]

PART_NAMES = ("train", "valid", "test")


def document_ranges(weights: Sequence[float], num_documents: int) -> list[tuple[int, int] | None]:
    """Document ranges ``[begin, end)`` per part for normalised ``weights`` (train, valid,
    test); None for a part of weight 0."""
    ends = [0.0]
    for w in weights:
        ends.append(ends[-1] + w)
    return [
        None if hi <= lo else (int(round(lo * num_documents)), int(round(hi * num_documents)))
        for lo, hi in zip(ends[:-1], ends[1:])
    ]


def _empty(ranges, required: Sequence[str], checked: Sequence[str]) -> list[str]:
    """The parts a dataset build refuses: a required part without documents, or a checked
    part that has a weight but no document."""
    empty = []
    for name, rng in zip(PART_NAMES, ranges):
        if rng is None and name in required:
            empty.append(name)
        elif rng is not None and rng[1] <= rng[0] and name in checked:
            empty.append(name)
    return empty


def _needed(weights, required: Sequence[str], checked: Sequence[str]) -> list[bool]:
    """Per part: whether it must get a document (required, or checked with a weight)."""
    return [name in required or (w > 0 and name in checked) for name, w in zip(PART_NAMES, weights)]


def _normalised(counts: Sequence[float]) -> list[float]:
    total = sum(counts)
    return [c / total for c in counts]


def fitting_split(
    weights: Sequence[float],
    num_documents: int,
    required: Sequence[str] = ("train", "valid"),
    checked: Sequence[str] = PART_NAMES,
) -> str | None:
    """A split near ``weights``, in documents per part (e.g. "19,1,0" for 20 documents), that
    gives every required part, and every checked part with a weight, at least one document;
    None when there are too few documents for that."""
    needed = _needed(weights, required, checked)
    counts = [
        max(1, round(w * num_documents)) if need else round(w * num_documents)
        for w, need in zip(weights, needed)
    ]
    counts[0] = num_documents - sum(counts[1:])
    if counts[0] < 1:  # the others as small as they may be; train takes the rest
        counts[1:] = [int(need) for need in needed[1:]]
        counts[0] = num_documents - sum(counts[1:])
    if counts[0] < int(needed[0]) or sum(counts) == 0:
        return None
    if _empty(document_ranges(_normalised(counts), num_documents), required, checked):
        return None
    return ",".join(str(c) for c in counts)


def split_problem(
    split: str,
    weights: Sequence[float],
    num_documents: int,
    required: Sequence[str] = ("train", "valid"),
    checked: Sequence[str] = PART_NAMES,
) -> str | None:
    """One line naming ``data.split`` when ``weights`` (its normalised values) leave a part
    the dataset build needs without documents (``required``: parts the run reads whatever
    their weight; ``checked``: parts refused when they have a weight but no document), with a
    split that fits; None when the split is fine."""
    empty = _empty(document_ranges(weights, num_documents), required, checked)
    if not empty:
        return None
    sets = " and ".join(f"the {name} set" for name in empty)
    documents = f"{num_documents} document{'s' if num_documents != 1 else ''}"
    problem = f"data.split={split!r} gives {sets} none of the dataset's {documents}"
    fits = fitting_split(weights, num_documents, required, checked)
    if fits is None:
        needed = _needed(weights, required, checked)
        parts = " and ".join(n for n, need in zip(PART_NAMES, needed) if need)
        return f"{problem}; {parts} need one each: the dataset needs more documents"
    return f"{problem}; one that fits: data.split={fits}"
