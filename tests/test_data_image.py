"""Image data: sources (sklearn digits, image folders, packed sets) read back real pixels, the
stratified split, resume-exact items and epochs, torchvision-style transforms against hand
computations, worker-process batching and the preprocess_images.py CLI.

The folder tree is written from the digits themselves (PNG for exact round trips, plus two
JPEG files to check that .jpg/.JPEG are read), so every test runs on real pixels offline.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from data.image_data import (
    ImageDataset,
    build_image_datasets,
    channel_mean_std,
    digits_source,
    folder_source,
    packed_source,
    split_indices,
    write_packed,
)
from data.sampler import micro_batches

REPO = Path(__file__).resolve().parents[1]
PER_CLASS = 20
SEED = 1234
NORM = {"mean": [0.3], "std": [0.4]}


@pytest.fixture(scope="module")
def digits():
    return digits_source()


@pytest.fixture(scope="module")
def tree(tmp_path_factory, digits):
    """``root/<digit>/NNN.png`` for the first 20 images of each digit, two JPEGs in ``3/``,
    and a file that is not an image; returns ``(root, expected)`` with the PNG pixels in the
    source's order (class folders, then file names)."""
    root = tmp_path_factory.mktemp("digits_tree")
    expected = []
    for k in range(10):
        folder = root / str(k)
        folder.mkdir()
        for n, i in enumerate(np.flatnonzero(digits.labels == k)[:PER_CLASS]):
            px = digits.image(int(i))[:, :, 0]
            Image.fromarray(px).save(folder / f"{n:03d}.png")
            expected.append((px, k))
    jpegs = np.flatnonzero(digits.labels == 3)[PER_CLASS : PER_CLASS + 2]
    for name, i in zip(("z1.jpg", "z2.JPEG"), jpegs):
        Image.fromarray(digits.image(int(i))[:, :, 0]).save(root / "3" / name, quality=95)
    (root / "3" / "notes.txt").write_text("not an image")
    return root, expected


def _dataset(source, n=None, *, train=True, **kw):
    indices = np.arange(len(source))
    args = dict(image_size=8, seed=SEED, part=0, train=train, **NORM)
    args.update(kw)
    return ImageDataset(source, indices, len(source) if n is None else n, **args)


# -- sources -----------------------------------------------------------------------------------


def test_digits_source_matches_sklearn(digits):
    from sklearn.datasets import load_digits

    raw = load_digits()
    assert len(digits) == 1797 and digits.channels == 1
    assert digits.classes == [str(k) for k in range(10)]
    assert np.array_equal(digits.labels, raw.target) and digits.labels.dtype == np.int64
    img = digits.image(5)
    assert img.dtype == np.uint8 and img.shape == (8, 8, 1)
    assert np.array_equal(img[:, :, 0], np.round(raw.images[5] * 255 / 16).astype(np.uint8))
    everything = np.stack([digits.image(i) for i in range(len(digits))])
    assert everything.min() == 0 and everything.max() == 255


def test_folder_source_reads_back_the_written_pixels(tree):
    root, expected = tree
    src = folder_source(root, channels=1)
    assert src.classes == [str(k) for k in range(10)] and len(src) == 10 * PER_CLASS + 2
    png = [i for i, f in enumerate(src.files) if f.endswith(".png")]
    assert len(png) == len(expected)
    for i, (px, label) in zip(png, expected):
        assert np.array_equal(src.image(i)[:, :, 0], px) and src.labels[i] == label
    jpegs = [i for i, f in enumerate(src.files) if not f.endswith(".png")]
    assert [src.files[i] for i in jpegs] == ["3/z1.jpg", "3/z2.JPEG"]
    assert all(src.labels[i] == 3 and src.image(i).shape == (8, 8, 1) for i in jpegs)
    rgb = folder_source(root)  # grayscale files converted to RGB: three equal channels
    img = rgb.image(png[0])
    assert img.shape == (8, 8, 3) and all(
        np.array_equal(img[..., c], expected[0][0]) for c in (1, 2)
    )


def test_folder_source_errors_name_the_path(tmp_path, tree):
    with pytest.raises(ValueError, match="does not exist"):
        folder_source(tmp_path / "missing")
    (tmp_path / "empty_root").mkdir()
    with pytest.raises(ValueError, match="no class sub-folders"):
        folder_source(tmp_path / "empty_root")
    bad = tmp_path / "bad"
    (bad / "a").mkdir(parents=True)
    (bad / "b").mkdir()
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(bad / "a" / "x.png")
    with pytest.raises(ValueError, match=r"class folder .*b'? holds no"):
        folder_source(bad)
    (bad / "b" / "broken.png").write_bytes(b"\x89PNG not really")
    src = folder_source(bad)
    with pytest.raises(ValueError, match="broken.png: cannot decode") as err:
        src.image(1)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="channels must be 1 or 3"):
        folder_source(tree[0], channels=2)


def test_packed_round_trip_is_bit_identical(tmp_path, tree, capsys):
    src = folder_source(tree[0], channels=1)
    meta = write_packed(src, tmp_path / "set", progress=True)
    assert "packing images: 202/202 images (100%)" in capsys.readouterr().err
    packed = packed_source(tmp_path / "set")
    assert meta["count"] == len(packed) == len(src) and meta["bytes"] == 64 * len(src)
    assert packed.classes == src.classes and packed.channels == 1
    assert np.array_equal(packed.labels, src.labels)
    assert all(np.array_equal(packed.image(i), src.image(i)) for i in range(len(src)))
    index = np.load(tmp_path / "set.index.npy", allow_pickle=False)
    assert index.dtype == np.int64 and index.shape == (len(src), 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "set.bin",
        "set.index.npy",
        "set.json",
        "set.labels.npy",
    ]
    copy = pickle.loads(pickle.dumps(packed))  # the memmap is reopened, not pickled
    assert "_mm" not in copy.__dict__ and np.array_equal(copy.image(7), src.image(7))


def test_packed_write_failure_leaves_nothing(tmp_path):
    class Broken:
        labels = np.zeros(3, np.int64)
        classes = ["only"]
        channels = 1

        def __len__(self):
            return 3

        def image(self, i):
            if i == 2:
                raise ValueError("image 2 is damaged")
            return np.zeros((4, 4, 1), np.uint8)

    with pytest.raises(ValueError, match="damaged"):
        write_packed(Broken(), tmp_path / "set")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="set.json is missing"):
        packed_source(tmp_path / "set")


def test_packed_source_rejects_a_truncated_bin(tmp_path, digits):
    write_packed(digits, tmp_path / "d")
    with open(tmp_path / "d.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="holds 100 bytes"):
        packed_source(tmp_path / "d")


def test_datasets_over_folder_and_packed_are_identical(tmp_path, tree):
    src = folder_source(tree[0])
    write_packed(src, tmp_path / "rgb")
    packed = packed_source(tmp_path / "rgb")
    for train in (True, False):
        kw = dict(image_size=12, crop_scale=(0.3, 1.0), hflip=True, train=train)
        a, b = _dataset(src, 40, **kw), _dataset(packed, 40, **kw)
        for i in range(0, 40, 3):
            x, y = a[i], b[i]
            assert torch.equal(x["images"], y["images"]) and torch.equal(x["labels"], y["labels"])


# -- split -------------------------------------------------------------------------------------


def test_split_is_stratified_disjoint_deterministic_and_covering(digits):
    parts = split_indices(digits.labels, "80,10,10", SEED)
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(digits)))
    counts = np.bincount(digits.labels)
    for p, w in zip(parts, (0.8, 0.1, 0.1)):
        assert np.all(np.abs(np.bincount(digits.labels[p], minlength=10) - w * counts) <= 1)
    again = split_indices(digits.labels, "8/1/1", SEED)  # same weights, other spelling
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = split_indices(digits.labels, "80,10,10", SEED + 1)
    assert not np.array_equal(parts[1], other[1])
    train, valid, test = split_indices(digits.labels, "90,10", SEED)  # missing test weight: 0
    assert test.size == 0 and train.size + valid.size == len(digits)


@pytest.mark.parametrize("split", ["", "a,b", "90,-10,0", "1,2,3,4", "0,0,0", "nan,1"])
def test_split_errors_name_the_option(split):
    with pytest.raises(ValueError, match="data.split"):
        split_indices(np.zeros(10, np.int64), split, SEED)


def test_build_image_datasets(tmp_path, tree, digits):
    src = folder_source(tree[0], channels=1)
    common = dict(seed=SEED, image_size=8, train_samples=50, valid_samples=10, **NORM)
    train, valid = build_image_datasets(digits, split="90,10,0", **common)
    assert train.train and not valid.train and (train.part, valid.part) == (0, 1)
    assert np.intersect1d(train.indices, valid.indices).size == 0 and len(valid) == 10
    assert build_image_datasets(digits, split="100,0,0", **common)[1] is None
    _, sep = build_image_datasets(digits, split="90,10,0", valid_source=src, **common)
    assert sep.source is src and sep.indices.size == len(src)
    with pytest.raises(ValueError, match="data.split '99.9,0.1,0' gives the valid set no"):
        build_image_datasets(src, split="99.9,0.1,0", **common)
    with pytest.raises(ValueError, match="data.split '0,1,0' has no train part"):
        build_image_datasets(src, split="0,1,0", **common)
    (tmp_path / "cat").mkdir()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "cat" / "a.png")
    with pytest.raises(ValueError, match="other classes"):
        build_image_datasets(src, split="1", valid_source=folder_source(tmp_path, 1), **common)


def test_channel_mean_std_matches_numpy(digits):
    idx = np.arange(0, len(digits), 7)
    mean, std = channel_mean_std(digits, idx)
    px = np.stack([digits.image(i) for i in idx]).astype(np.float64) / 255
    assert mean.dtype == np.float64 and mean.shape == (1,)
    np.testing.assert_allclose(mean, [px.mean()], rtol=1e-12)
    np.testing.assert_allclose(std, [px.std()], rtol=1e-10)


# -- items -------------------------------------------------------------------------------------


def test_items_are_resume_exact_in_any_order_and_process(digits):
    ds = _dataset(digits, 3 * len(digits), crop_scale=(0.3, 1.0), hflip=True, image_size=10)
    picks = [5, 1796, 1797, 4000, 12]
    first = {i: ds[i] for i in picks}
    fresh = _dataset(digits, 3 * len(digits), crop_scale=(0.3, 1.0), hflip=True, image_size=10)
    copy = pickle.loads(pickle.dumps(ds))
    for other in (fresh, copy):
        for i in reversed(picks):  # another read order, another object
            assert torch.equal(other[i]["images"], first[i]["images"])
            assert torch.equal(other[i]["labels"], first[i]["labels"])
    item = first[5]
    assert set(item) == {"images", "labels"}
    assert item["images"].dtype == torch.float32 and item["images"].shape == (1, 10, 10)
    assert item["labels"].dtype == torch.int64 and item["labels"].shape == ()
    with pytest.raises(IndexError):
        ds[3 * len(digits)]


def test_epochs_reshuffle_and_show_each_image_once(digits):
    idx = np.flatnonzero(digits.labels < 3)
    n = idx.size
    ds = ImageDataset(digits, idx, 3 * n, image_size=8, seed=SEED, part=0, train=False, **NORM)
    epochs = [[ds.source_index(e * n + k) for k in range(n)] for e in range(3)]
    for order in epochs:
        assert sorted(order) == idx.tolist()
    assert epochs[0] != epochs[1] != epochs[2]
    other_part = ImageDataset(digits, idx, n, image_size=8, seed=SEED, part=1, train=False, **NORM)
    assert [other_part.source_index(k) for k in range(n)] != epochs[0]


def test_train_augments_afresh_each_epoch_valid_is_fixed(digits):
    n = len(digits)
    kw = dict(image_size=12, crop_scale=(0.3, 1.0))
    train, valid = _dataset(digits, 2 * n, **kw), _dataset(digits, 2 * n, train=False, **kw)
    where = {train.source_index(n + k): n + k for k in range(n)}  # image -> its epoch-1 item
    differ = 0
    for k in range(20):
        img, again = train.source_index(k), where[train.source_index(k)]
        differ += not torch.equal(train[k]["images"], train[again]["images"])
        assert torch.equal(train[k]["labels"], train[again]["labels"])
        assert torch.equal(valid[k]["images"], valid[where[img]]["images"])
    assert differ >= 18  # two random crops of one image coincide only by chance


def test_identity_cases(digits):
    for ds in (
        _dataset(digits, 30, crop_scale=(1.0, 1.0)),  # whole-image crop, resize 8 -> 8
        _dataset(digits, 30, train=False, crop_ratio=1.0),  # shorter side 8, centre crop 8
    ):
        for i in range(30):
            assert np.array_equal(ds.pixels(i), digits.image(ds.source_index(i)))


def test_hflip_mirrors_about_half_the_items(digits):
    ds = _dataset(digits, 200, crop_scale=(1.0, 1.0), hflip=True)
    flipped = 0
    for i in range(200):
        img, got = digits.image(ds.source_index(i)), ds.pixels(i)
        mirrored = np.array_equal(got, img[:, ::-1]) and not np.array_equal(img, img[:, ::-1])
        assert mirrored or np.array_equal(got, img)
        flipped += mirrored
    assert 70 <= flipped <= 130


def test_crop_fallback_and_eval_resize_follow_torchvision(tmp_path):
    """An 8x20 image is too wide for any (3/4, 4/3) crop at full area: RandomResizedCrop falls
    back to the centred 8x11 crop (w = round(8 * 4/3), left = (20 - 11) // 2)."""
    rng = np.random.default_rng(0)
    wide = rng.integers(0, 256, size=(8, 20, 3), dtype=np.uint8)
    (tmp_path / "c").mkdir()
    Image.fromarray(wide).save(tmp_path / "c" / "w.png")
    src = folder_source(tmp_path)
    crop = _dataset(src, 1, image_size=6, crop_scale=(1.0, 1.0))
    want = Image.fromarray(wide[:, 4:15]).resize((6, 6), Image.Resampling.BILINEAR)
    assert np.array_equal(crop.pixels(0), np.asarray(want))
    # Eval: shorter side 8 -> round(6 / 0.75) = 8 (no resize), centre 6x6 at top 1, left 7.
    view = _dataset(src, 1, image_size=6, train=False, crop_ratio=0.75)
    assert np.array_equal(view.pixels(0), wide[1:7, 7:13])
    # crop_ratio 0.875: 8 -> round(6 / 0.875) = 7 rows, int(7 * 20 / 8) = 17 columns.
    view = _dataset(src, 1, image_size=6, train=False)
    small = np.asarray(Image.fromarray(wide).resize((17, 7), Image.Resampling.BILINEAR))
    assert np.array_equal(view.pixels(0), small[0:6, 6:12])  # round(0.5) = 0, round(5.5) = 6


def test_normalisation_by_hand(tree):
    src = folder_source(tree[0])
    mean, std = [0.1, 0.5, 0.9], [0.2, 0.3, 0.6]
    ds = _dataset(src, 10, crop_scale=(1.0, 1.0), mean=mean, std=std)
    for i in range(10):
        px = src.image(ds.source_index(i)).astype(np.float64)
        want = (px / 255 - np.array(mean)) / np.array(std)
        got = ds[i]["images"].numpy()
        np.testing.assert_allclose(got, want.transpose(2, 0, 1), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="mean has 2 values"):
        _dataset(src, 10, mean=[0.1, 0.2], std=[1.0])


def test_micro_batches_with_workers_equal_in_process(tree):
    ds = _dataset(folder_source(tree[0]), 64, crop_scale=(0.3, 1.0), hflip=True, image_size=12)
    args = dict(consumed_samples=8, micro_batch_size=4, dp_rank=1, dp_size=2)
    serial = list(micro_batches(ds, **args))
    parallel = list(micro_batches(ds, **args, num_workers=2))
    assert len(serial) == len(parallel) == 7
    for a, b in zip(serial, parallel):
        assert a["images"].shape == (4, 3, 12, 12) and a["labels"].shape == (4,)
        assert torch.equal(a["images"], b["images"]) and torch.equal(a["labels"], b["labels"])
    with pytest.raises(ValueError, match="num_workers"):
        micro_batches(ds, **args, num_workers=-1)


# -- tools/preprocess_images.py ----------------------------------------------------------------


def _cli(*args):
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_images.py"), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def test_cli_packs_a_folder(tmp_path, tree):
    prefix = tmp_path / "out" / "digits"
    proc = _cli("--input", tree[0], "--output-prefix", prefix, "--channels", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == [f"output_prefix: {prefix} images: 202 classes: 10 channels: 1 bytes: 12928"]
    assert "packing images: 202/202 images (100%)" in proc.stderr
    meta = json.loads(prefix.with_suffix(".json").read_text())
    assert meta["count"] == 202 and meta["source"] == f"image folder {tree[0]}"
    assert len(packed_source(prefix)) == 202


def test_cli_missing_input_is_one_line_exit_2(tmp_path):
    proc = _cli("--input", tmp_path / "nope", "--output-prefix", tmp_path / "new" / "x")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "--input" in proc.stderr and "nope" in proc.stderr
    assert list(tmp_path.iterdir()) == []
