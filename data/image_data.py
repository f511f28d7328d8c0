"""Image-classification data for ViT: image sources, a stratified split and resumable,
augmented map-style datasets.

Sources. A source is a list of labelled images read one at a time: ``len``, ``labels``
(int64 [N]), ``classes`` (names, index = class id), ``channels`` (1 or 3) and ``image(i)``, a
uint8 [H, W, C] array at the size it is stored. Three kinds:

- :func:`digits_source`: scikit-learn's bundled handwritten digits (1,797 8x8 grayscale
  images, 10 classes). Real pixels that ship with an installed package, so tests and the
  default ViT run need no download.
- :func:`folder_source`: an ImageNet-style tree, one sub-folder per class (sorted names are
  the class ids, as torchvision's ``ImageFolder``), .png/.jpg/.jpeg files found recursively
  and sorted by path, decoded by Pillow on demand.
- :func:`packed_source`: what :func:`write_packed` (and ``tools/preprocess_images.py``)
  writes: one memory-mapped uint8 ``.bin`` with every image's pixels back to back at its
  stored size, plus an offset/shape index. Nothing is resized when packing, so a packed set
  and the folder it came from give bit-identical items: packing only removes decoding cost.

Split. :func:`split_indices` cuts Megatron's ``"train,valid,test"`` weights per class after a
seeded permutation, so every part keeps the class balance (up to rounding per class). A
separate validation folder (ImageNet's ``val/``) may replace the split's valid part in
:func:`build_image_datasets`.

Items, resume-exact (the scheme of ``data/mlm_data.py``). Item ``i`` of an
:class:`ImageDataset` over ``n`` images is in epoch ``e = i // n``; the epoch visits the
images in a permutation drawn from ``(seed, part, ORDER, e)`` and item ``i`` takes position
``i % n`` of it. Its augmentation is drawn from a Generator seeded by ``(seed, part, AUG, i)``
alone. So the same ``i`` is the same item in any process, after any reads, pickled or not;
every image is seen once per epoch; an image seen again in a later epoch gets fresh
augmentation. No global RNG, no torch.distributed, no files written: every rank builds the
same datasets and a sampler picks its items (``data/sampler.py``).

Transforms follow torchvision's ImageNet recipe on Pillow images (bilinear, antialiased):
training is ``RandomResizedCrop`` (area fraction in ``crop_scale``, log-uniform aspect ratio
in (3/4, 4/3), ten tries then a centre-crop fallback) then an optional horizontal flip (off by
default: it turns digits into other shapes); evaluation resizes the shorter side to
``image_size / crop_ratio`` (rounded half up) and centre-crops ``image_size``. Then
``(pixels / 255 - mean[c]) / std[c]`` in float32. An item is ``{"images": float32 [C, S, S],
"labels": int64 scalar}``.

torch and scikit-learn are imported where they are needed (about 3 s and 2 s): packing a
folder with ``tools/preprocess_images.py`` needs neither.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from PIL import Image

from data.progress import Progress
from data.seeded import keyed_rng

if TYPE_CHECKING:
    import torch

__all__ = [
    "ImageSource",
    "digits_source",
    "folder_source",
    "packed_source",
    "check_source",
    "write_packed",
    "split_indices",
    "channel_mean_std",
    "ImageDataset",
    "build_image_datasets",
]

_ORDER, _AUG, _SPLIT = 0, 1, 2  # RNG stream tags
_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg"})
_PACKED_FORMAT, _PACKED_VERSION = "fp8train-packed-images", 1
_SUFFIXES = (".bin", ".index.npy", ".labels.npy", ".json")  # the json is published last
_LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))  # RandomResizedCrop's aspect-ratio range
_CROP_TRIES = 10
_BILINEAR = Image.Resampling.BILINEAR


class ImageSource(Protocol):
    """What datasets and :func:`write_packed` read (see the module docstring)."""

    labels: np.ndarray
    classes: list[str]
    channels: int

    def __len__(self) -> int: ...

    def image(self, i: int) -> np.ndarray: ...


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


# -- sources -----------------------------------------------------------------------------------


class _DigitsSource:
    description = "sklearn.datasets.load_digits"
    channels = 1
    classes = [str(k) for k in range(10)]

    def __init__(self) -> None:
        from sklearn.datasets import load_digits  # bundled with the package: no download

        digits = load_digits()
        # Values are the integers 0..16 (set pixels per 4x4 block); only 8 lands on a half
        # (127.5), which rounds to 128 half-even and half-up alike.
        pixels = np.rint(digits.images * (255 / 16)).astype(np.uint8)
        pixels.flags.writeable = False
        self._pixels = pixels[..., None]  # [N, 8, 8, 1]
        self.labels = np.asarray(digits.target, dtype=np.int64)

    def __len__(self) -> int:
        return self._pixels.shape[0]

    def image(self, i: int) -> np.ndarray:
        return self._pixels[i]


def digits_source() -> _DigitsSource:
    """scikit-learn's 1,797 8x8 handwritten digits, uint8 ``round(v * 255 / 16)``, C = 1."""
    return _DigitsSource()


def _image_files(folder: Path) -> list[Path]:
    found = [
        p
        for p in folder.rglob("*")
        if p.suffix.lower() in _EXTENSIONS
        and p.is_file()
        and not any(s.startswith(".") for s in p.relative_to(folder).parts)
    ]
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


class _FolderSource:
    def __init__(self, root: str | os.PathLike[str], channels: int = 3) -> None:
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {channels}")
        base = Path(root)
        classes = _class_folders(base)
        files: list[str] = []
        labels: list[int] = []
        for k, name in enumerate(classes):
            found = _image_files(base / name)
            if not found:
                raise ValueError(
                    f"class folder {str(base / name)!r} holds no .png/.jpg/.jpeg image"
                )
            files.extend(p.relative_to(base).as_posix() for p in found)
            labels.extend([k] * len(found))
        self.root = str(base)
        self.files = files  # relative to root: the source pickles small and holds no handle
        self.labels = np.array(labels, dtype=np.int64)
        self.classes = classes
        self.channels = channels
        self.description = f"image folder {self.root}"

    def __len__(self) -> int:
        return len(self.files)

    def path(self, i: int) -> str:
        return os.path.join(self.root, self.files[i])

    def image(self, i: int) -> np.ndarray:
        with _opened_image(self.path(i)) as im:
            rgb_or_l = im.convert("RGB" if self.channels == 3 else "L")
        pixels = np.asarray(rgb_or_l, dtype=np.uint8)
        return pixels.reshape(pixels.shape[0], pixels.shape[1], self.channels)

    def verify(self, progress: bool = False) -> None:
        """Check every file without decoding it, before anything is written from them: Pillow
        must recognise its header, and a PNG's chunks must be complete with intact CRCs (a
        truncated or altered PNG fails here; a damaged JPEG only when decoded). Raises
        ValueError naming the first bad file, as ``image`` does."""
        bar = Progress("checking images", len(self), unit="images") if progress else None
        try:
            for i in range(len(self)):
                with _opened_image(self.path(i)) as im:
                    im.verify()
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:  # the packing line, or the error's one line, follows at once
                bar.clear()


@contextmanager
def _opened_image(path: str) -> Iterator[Image.Image]:
    """``Image.open(path)``; a failure in the block is a one-line ValueError naming the file.
    Pillow reports damaged files through several exception types (OSError, SyntaxError,
    ValueError, DecompressionBombError, ...): all of them mean this file cannot be used."""
    try:
        with Image.open(path) as im:
            yield im
    except Exception as err:
        raise ValueError(f"{path}: cannot decode image ({_one_line(err)})") from None


def _class_folders(base: Path) -> list[str]:
    if not base.is_dir():
        raise ValueError(f"image folder {str(base)!r} does not exist or is not a directory")
    classes = sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ValueError(f"image folder {str(base)!r} has no class sub-folders")
    return classes


def folder_source(root: str | os.PathLike[str], channels: int = 3) -> _FolderSource:
    """Images under ``root/<class>/...`` converted to RGB (``channels=3``) or L (``1``)."""
    return _FolderSource(root, channels)


class _PackedSource:
    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = os.fspath(prefix)
        meta = _read_packed_meta(self.prefix)
        try:
            index = np.load(self.prefix + ".index.npy", allow_pickle=False)
            labels = np.load(self.prefix + ".labels.npy", allow_pickle=False)
        except (OSError, ValueError) as err:
            raise ValueError(f"packed images {self.prefix!r}: {_one_line(err)}") from None
        self._index = index
        self.labels = labels
        self.classes = [str(c) for c in meta["classes"]]
        self.channels = int(meta["channels"])
        self.description = f"packed images {self.prefix} ({meta['source']})"
        self._check(int(meta["count"]))

    def _check(self, count: int) -> None:
        index, labels = self._index, self.labels
        problem = None
        if index.dtype != np.int64 or index.shape != (count, 4):
            problem = f"index is {index.dtype} {index.shape}, expected int64 ({count}, 4)"
        elif labels.dtype != np.int64 or labels.shape != (count,):
            problem = f"labels are {labels.dtype} {labels.shape}, expected int64 ({count},)"
        elif count and (labels.min() < 0 or labels.max() >= len(self.classes)):
            problem = f"labels outside [0, {len(self.classes)})"
        elif count and (index[:, 3] != self.channels).any():
            problem = f"an image does not have {self.channels} channel(s)"
        else:
            size = int(index[-1, 0] + index[-1, 1:].prod()) if count else 0
            actual = os.path.getsize(self.prefix + ".bin")
            if actual != size:
                problem = f".bin holds {actual} bytes, the index describes {size}"
        if problem:
            raise ValueError(f"packed images {self.prefix!r}: {problem}")

    def __len__(self) -> int:
        return self._index.shape[0]

    def _pixels(self) -> np.memmap:
        mm = self.__dict__.get("_mm")
        if mm is None:
            mm = np.memmap(self.prefix + ".bin", dtype=np.uint8, mode="r")
            self._mm = mm
        return mm

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_mm", None)  # reopened lazily: DataLoader workers pickle the dataset
        return state

    def image(self, i: int) -> np.ndarray:
        offset, h, w, c = (int(v) for v in self._index[i])
        return np.array(self._pixels()[offset : offset + h * w * c]).reshape(h, w, c)


def _read_packed_meta(prefix: str) -> dict[str, Any]:
    path = prefix + ".json"
    if not os.path.isfile(path):
        raise ValueError(
            f"packed images {prefix!r}: {path} is missing (never written or unfinished)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"packed images {prefix!r}: {path}: {_one_line(err)}") from None
    if meta.get("format") != _PACKED_FORMAT or meta.get("version") != _PACKED_VERSION:
        raise ValueError(
            f"packed images {prefix!r}: {path} is not {_PACKED_FORMAT} version {_PACKED_VERSION}"
        )
    return meta


def packed_source(prefix: str | os.PathLike[str]) -> _PackedSource:
    """The images :func:`write_packed` wrote at ``prefix`` (the .bin is memory-mapped lazily)."""
    return _PackedSource(prefix)


def check_source(kind: str, path: str | os.PathLike[str] | None, channels: int = 3):
    """Pre-flight of a source, decoding no image: ``(class names, channels)``. "digits" is
    bundled; "folder" checks the root and its class sub-folders (their images are listed when
    the run opens the folder); "packed" checks the whole index and the sizes. Raises
    ValueError naming the path."""
    if kind == "digits":
        return list(_DigitsSource.classes), _DigitsSource.channels
    if kind == "folder":
        return _class_folders(Path(path)), channels
    source = packed_source(path)
    return source.classes, source.channels


# -- packing -----------------------------------------------------------------------------------


def _checked_image(source: ImageSource, i: int) -> np.ndarray:
    img = np.asarray(source.image(i))
    if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != source.channels or not img.size:
        raise ValueError(
            f"image {i} is {img.dtype} {img.shape}, expected uint8 [H, W, {source.channels}]"
        )
    return np.ascontiguousarray(img)


def _write_synced(path: str, write: Any) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename publishes it


def _write_pixels(source: ImageSource, path: str, progress: bool) -> np.ndarray:
    """Every image's pixels back to back into ``path``; returns the [N, 4] index."""
    n = len(source)
    index = np.empty((n, 4), dtype=np.int64)
    bar = Progress("packing images", n, unit="images") if progress else None

    def write(f: Any) -> None:
        offset = 0
        for i in range(n):
            img = _checked_image(source, i)
            f.write(img.data)
            index[i] = (offset, *img.shape)
            offset += img.size
            if bar is not None:
                bar.update(1, img.nbytes)

    try:
        _write_synced(path, write)
    except BaseException:
        if bar is not None:  # the error's message is the one line that follows
            bar.clear()
        raise
    if bar is not None:
        bar.close()
    return index


def write_packed(
    source: ImageSource, prefix: str | os.PathLike[str], progress: bool = False
) -> dict[str, Any]:
    """Pack ``source`` at ``prefix`` (.bin, .index.npy, .labels.npy, .json); returns the json.

    Files are written under temporary names and renamed into place, the json last (after the
    old json, if any, is removed): a crash never leaves a set that :func:`packed_source`
    reads as complete. ``progress`` draws a one-line progress bar on stderr.
    """
    prefix = os.fspath(prefix)
    n = len(source)
    if n == 0:
        raise ValueError(f"{_describe(source)} holds no images")
    labels = np.asarray(source.labels, dtype=np.int64)
    if labels.shape != (n,) or labels.min() < 0 or labels.max() >= len(source.classes):
        raise ValueError(f"{_describe(source)}: labels must be {n} class ids in [0, classes)")
    temp = {s: f"{prefix}{s}.tmp{os.getpid()}" for s in _SUFFIXES}
    try:
        index = _write_pixels(source, temp[".bin"], progress)
        meta = {
            "format": _PACKED_FORMAT,
            "version": _PACKED_VERSION,
            "count": n,
            "channels": int(source.channels),
            "classes": [str(c) for c in source.classes],
            "bytes": int(index[-1, 0] + index[-1, 1:].prod()),
            "source": _describe(source),
        }
        # np.save on a file object: given a name it would append ".npy" to the temporary one.
        _write_synced(temp[".index.npy"], lambda f: np.save(f, index, allow_pickle=False))
        _write_synced(temp[".labels.npy"], lambda f: np.save(f, labels, allow_pickle=False))
        text = json.dumps(meta, indent=1).encode()
        _write_synced(temp[".json"], lambda f: f.write(text))
        Path(prefix + ".json").unlink(missing_ok=True)  # old arrays never pair with a json
        for suffix in _SUFFIXES:
            os.replace(temp[suffix], prefix + suffix)
    except BaseException:
        for path in temp.values():
            Path(path).unlink(missing_ok=True)
        raise
    return meta


def _describe(source: Any) -> str:
    return str(getattr(source, "description", type(source).__name__))


# -- split and statistics ----------------------------------------------------------------------


def _split_weights(split: str) -> np.ndarray:
    """Megatron's split string ("90,10,0", "98/2/0", "100") as weights summing to 1."""
    fields = [f.strip() for f in str(split).replace("/", ",").split(",")]
    try:
        weights = [float(f) for f in fields]
    except ValueError:
        weights = []
    if not weights or len(weights) > 3 or not all(math.isfinite(w) and w >= 0 for w in weights):
        raise ValueError(
            f"data.split {split!r}: expected up to three non-negative weights 'train,valid,test'"
        )
    if sum(weights) <= 0:
        raise ValueError(f"data.split {split!r}: the weights sum to zero")
    out = np.array(weights + [0.0] * (3 - len(weights)))
    return out / out.sum()


def split_indices(labels: Any, split: str, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(train, valid, test)`` ascending int64 index arrays, stratified by class.

    Each class's members are permuted (one Generator seeded by ``seed``) and cut at
    ``round(cumulative weight * class size)`` (half up): every part keeps the class balance up
    to one image per class, the parts are disjoint and cover every index.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    bookends = np.concatenate(([0.0], np.cumsum(_split_weights(split))))
    bookends[-1] = 1.0  # exactly: the test part ends at each class's end
    perm = keyed_rng(int(seed), 0, _SPLIT, 0).permutation(labels.size)
    _, cls = np.unique(labels[perm], return_inverse=True)
    order = perm[np.argsort(cls, kind="stable")]  # grouped by class, permuted within each
    counts = np.bincount(cls)
    starts = np.cumsum(counts) - counts
    rank = np.arange(labels.size) - np.repeat(starts, counts)  # position inside its class
    cuts = np.floor(bookends[None, :] * counts[:, None] + 0.5).astype(np.int64)  # [K, 4]
    part = (rank >= np.repeat(cuts[:, 1], counts)).astype(np.int64)
    part += rank >= np.repeat(cuts[:, 2], counts)
    parts = (np.sort(order[part == p]).astype(np.int64) for p in range(3))
    return tuple(parts)  # type: ignore[return-value]


def channel_mean_std(source: ImageSource, indices: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std (float64 [C]) of ``pixels / 255`` over all pixels of the
    images ``indices`` (every pixel weighs the same; population std)."""
    c = source.channels
    total = np.zeros(c, dtype=np.int64)  # exact integer sums: no cancellation in the variance
    squares = np.zeros(c, dtype=np.int64)
    count = 0
    for i in np.asarray(indices, dtype=np.int64):
        px = source.image(int(i)).reshape(-1, c).astype(np.int64)
        total += px.sum(axis=0)
        squares += (px * px).sum(axis=0)
        count += px.shape[0]
    if count == 0:
        raise ValueError("no images to compute channel statistics over")
    mean = total / count
    var = np.maximum(squares / count - mean * mean, 0.0)
    return mean / 255.0, np.sqrt(var) / 255.0


# -- transforms --------------------------------------------------------------------------------


def _resize(img: np.ndarray, height: int, width: int) -> np.ndarray:
    if img.shape[:2] == (height, width):
        return img
    pil = Image.fromarray(img[:, :, 0] if img.shape[2] == 1 else img)
    out = np.asarray(pil.resize((width, height), _BILINEAR))
    return out.reshape(height, width, img.shape[2])


def _crop_box(
    rng: np.random.Generator, height: int, width: int, scale: tuple[float, float]
) -> tuple[int, int, int, int]:
    """``(top, left, h, w)``: torchvision's ``RandomResizedCrop.get_params`` with numpy draws."""
    area = height * width
    for _ in range(_CROP_TRIES):
        target = area * rng.uniform(scale[0], scale[1])
        ratio = math.exp(rng.uniform(*_LOG_RATIO))
        w = int(round(math.sqrt(target * ratio)))
        h = int(round(math.sqrt(target / ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    # Fallback: the largest centred crop whose aspect ratio is inside the range.
    in_ratio = width / height
    if in_ratio < 3 / 4:
        w, h = width, int(round(width / (3 / 4)))
    elif in_ratio > 4 / 3:
        w, h = int(round(height * (4 / 3))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _center_crop(img: np.ndarray, size: int) -> np.ndarray:
    h, w = img.shape[:2]
    top = int(round((h - size) / 2.0))  # torchvision's CenterCrop rounding
    left = int(round((w - size) / 2.0))
    return img[top : top + size, left : left + size]


def _eval_view(img: np.ndarray, size: int, crop_ratio: float) -> np.ndarray:
    """Shorter side resized to ``size / crop_ratio`` (half up), then the centre ``size``."""
    short = math.floor(size / crop_ratio + 0.5)
    h, w = img.shape[:2]
    if h <= w:
        new_h, new_w = short, int(short * w / h)  # torchvision's Resize(int) truncation
    else:
        new_h, new_w = int(short * h / w), short
    return _center_crop(_resize(img, new_h, new_w), size)


def _channel_values(values: Sequence[float], channels: int, name: str) -> np.ndarray:
    out = np.asarray(values, dtype=np.float32).reshape(-1)
    if out.size not in (1, channels):
        raise ValueError(f"{name} has {out.size} values; the images have {channels} channel(s)")
    return np.broadcast_to(out, (channels,)).copy()


# -- datasets ----------------------------------------------------------------------------------


class ImageDataset:
    """Map-style classification dataset of ``num_samples`` items over ``source[indices]``.

    ``part`` (0 train, 1 valid, 2 test) separates the RNG streams of the split parts; ``train``
    picks the augmenting transform (module docstring). Use :func:`build_image_datasets`.
    """

    def __init__(
        self,
        source: ImageSource,
        indices: Any,
        num_samples: int,
        *,
        image_size: int,
        seed: int,
        part: int,
        train: bool,
        mean: Sequence[float],
        std: Sequence[float],
        crop_scale: tuple[float, float] = (0.8, 1.0),
        hflip: bool = False,
        crop_ratio: float = 0.875,
    ) -> None:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size == 0:
            raise ValueError("an image dataset needs at least one image")
        if indices.min() < 0 or indices.max() >= len(source):
            raise ValueError(f"image indices outside [0, {len(source)})")
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if image_size <= 0:
            raise ValueError(f"image_size must be positive, got {image_size}")
        if not 0 <= seed < 2**32 or not 0 <= part < 2**32:
            raise ValueError(f"seed ({seed}) and part ({part}) must be in [0, 2**32)")
        lo, hi = (float(v) for v in crop_scale)
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < low <= high <= 1, got {crop_scale}")
        if not 0 < crop_ratio <= 1:
            raise ValueError(f"crop_ratio must be in (0, 1], got {crop_ratio}")
        self.source = source
        self.indices = indices
        self.num_samples = int(num_samples)
        self.image_size = int(image_size)
        self.seed, self.part, self.train = int(seed), int(part), bool(train)
        self.crop_scale, self.hflip, self.crop_ratio = (lo, hi), bool(hflip), float(crop_ratio)
        self.mean = _channel_values(mean, source.channels, "mean")
        self.std = _channel_values(std, source.channels, "std")
        if (self.std <= 0).any():
            raise ValueError(f"std must be positive, got {list(std)}")
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_orders"] = OrderedDict()  # cheap to redraw; keeps worker pickles small
        return state

    def _order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            order = keyed_rng(self.seed, self.part, _ORDER, epoch).permutation(self.indices.size)
            self._orders[epoch] = order
            while len(self._orders) > 2:  # an epoch boundary touches two epochs
                self._orders.popitem(last=False)
        return order

    def source_index(self, index: int) -> int:
        """The source image item ``index`` shows."""
        epoch, pos = divmod(int(index), self.indices.size)
        return int(self.indices[self._order(epoch)[pos]])

    def pixels(self, index: int) -> np.ndarray:
        """Item ``index`` as transformed uint8 pixels [S, S, C], before normalisation."""
        return self._view(self.source.image(self.source_index(index)), int(index))

    def _view(self, img: np.ndarray, index: int) -> np.ndarray:
        if not self.train:
            return _eval_view(img, self.image_size, self.crop_ratio)
        rng = keyed_rng(self.seed, self.part, _AUG, index)
        top, left, h, w = _crop_box(rng, img.shape[0], img.shape[1], self.crop_scale)
        out = _resize(img[top : top + h, left : left + w], self.image_size, self.image_size)
        if rng.random() < 0.5 and self.hflip:  # drawn either way: hflip leaves crops alone
            out = out[:, ::-1]
        return out

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        import torch

        i = int(index)
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {index} is outside [0, {self.num_samples})")
        image = self.source_index(i)
        x = self._view(self.source.image(image), i).astype(np.float32) / np.float32(255)
        x = (x - self.mean) / self.std  # [S, S, C]: mean and std broadcast over channels last
        label = self.source.labels[image]
        return {
            "images": torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1))),
            "labels": torch.tensor(int(label), dtype=torch.int64),
        }


def build_image_datasets(
    source: ImageSource,
    *,
    split: str,
    seed: int,
    image_size: int,
    train_samples: int,
    valid_samples: int,
    mean: Sequence[float],
    std: Sequence[float],
    crop_scale: tuple[float, float] = (0.8, 1.0),
    hflip: bool = False,
    crop_ratio: float = 0.875,
    valid_source: ImageSource | None = None,
) -> tuple[ImageDataset, ImageDataset | None]:
    """``(train, valid)``: train augments the split's train part; valid is its valid part.

    With ``valid_source`` (a separate validation set, ImageNet's ``val/``) validation is all
    of it and the split's valid part is used by neither dataset: give ``split`` "100,0,0" to
    train on the whole ``source``. ``valid`` is None when there is no validation part
    (``valid_samples`` is then unused). A part with weight but no images raises ValueError.
    """
    weights = _split_weights(split)
    parts = split_indices(source.labels, split, seed)
    common: dict[str, Any] = dict(
        image_size=image_size,
        seed=seed,
        mean=mean,
        std=std,
        crop_scale=crop_scale,
        hflip=hflip,
        crop_ratio=crop_ratio,
    )
    if weights[0] == 0:
        raise ValueError(f"data.split {split!r} has no train part")
    use_split_valid = valid_source is None and weights[1] > 0
    for p, name in ((0, "train"), (1, "valid")):
        if parts[p].size == 0 and (p == 0 or use_split_valid):
            raise ValueError(
                f"data.split {split!r} gives the {name} set no images "
                f"({len(source)} in {_describe(source)})"
            )
    train = ImageDataset(source, parts[0], train_samples, part=0, train=True, **common)
    if valid_source is not None:
        if list(valid_source.classes) != list(source.classes):
            raise ValueError(
                f"{_describe(valid_source)} has other classes than {_describe(source)}"
            )
        if valid_source.channels != source.channels:
            raise ValueError(f"{_describe(valid_source)} has {valid_source.channels} channels")
        everything = np.arange(len(valid_source))
        return train, ImageDataset(
            valid_source, everything, valid_samples, part=1, train=False, **common
        )
    if not use_split_valid:
        return train, None
    return train, ImageDataset(source, parts[1], valid_samples, part=1, train=False, **common)
