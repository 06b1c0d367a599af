"""Load a dataset from ``[data]`` and split it into federated clients.

One entry point, :func:`load_federated`, for every dataset: Synthetic(alpha, beta)
(made here), MNIST and Fashion-MNIST (official idx files), FEMNIST (LEAF JSON). This
module finds the files, checks them against the folder's ``SHA256SUMS`` and picks the
partitioner; the formats live in ``idx``/``leaf``, the splits in ``partition``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import partition, synthetic
from .config import DataConfig
from .errors import ConfigError, DataError
from .idx import read_idx
from .leaf import UserData, read_split

log = logging.getLogger(__name__)

IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
IDX_SOURCES = {
    "mnist": "the official MNIST idx files (http://yann.lecun.com/exdb/mnist/)",
    "fashion-mnist": "the official Fashion-MNIST idx files (https://github.com/zalandoresearch/fashion-mnist)",
}
LEAF_SOURCE = (
    "LEAF's FEMNIST preprocessing: the train/ and test/ folders of JSON files that "
    "data/femnist/preprocess.sh of https://github.com/TalwalkarLab/leaf writes"
)
IMAGE_SHAPE = (1, 28, 28)
FEMNIST_CLASSES = 62
CHECKSUM_FILE = "SHA256SUMS"


@dataclass
class ArrayDataset:
    """Samples held in memory as tensors: what a client trains on."""

    x: torch.Tensor  # float32 (N, *input_shape)
    y: torch.Tensor  # int64 (N,)

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class FederatedData:
    """A training set split into clients, plus the global held-out test set."""

    name: str
    train: ArrayDataset
    test: ArrayDataset
    client_indices: list[np.ndarray]  # int64 indices into train; each index in exactly one client
    input_shape: tuple[int, ...]
    num_classes: int

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    def client(self, i: int) -> ArrayDataset:
        idx = torch.from_numpy(self.client_indices[i])
        return ArrayDataset(self.train.x[idx], self.train.y[idx])


# --- checksums -----------------------------------------------------------------------

_digests: dict[tuple[str, int, int], str] = {}


def sha256_of(path: Path) -> str:
    """The file's sha256, computed once per process for each (path, mtime, size)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    if key not in _digests:
        with path.open("rb") as f:
            _digests[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _digests[key]


def read_checksums(directory: Path) -> dict[str, str]:
    """``SHA256SUMS`` (``<hex>  <name>`` lines, as sha256sum writes) -> {name: hex}; {} if absent."""
    path = directory / CHECKSUM_FILE
    if not path.is_file():
        return {}
    sums: dict[str, str] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        digest, _, name = line.partition(" ")
        name = name.strip().removeprefix("*")
        if len(digest) != 64 or not name or any(c not in "0123456789abcdefABCDEF" for c in digest):
            raise DataError(f"{path}:{lineno}: expected '<64 hex digits>  <file name>', got {line!r}")
        sums[name] = digest.lower()
    return sums


def verify(directory: Path, path: Path, sums: dict[str, str]) -> None:
    """Check ``path`` against its ``SHA256SUMS`` entry; files not listed pass unchecked."""
    name = path.relative_to(directory).as_posix()
    expected = sums.get(name)
    if expected is None:
        log.info("%s is not listed in %s: read without a checksum", path, CHECKSUM_FILE)
        return
    got = sha256_of(path)
    if got != expected:
        raise DataError(
            f"{path}: sha256 mismatch: {CHECKSUM_FILE} expects {expected}, got {got}; "
            "the file is corrupt or not the official one (re-download it, or set data.verify_checksums = false)"
        )


# --- readers -------------------------------------------------------------------------


def _tensors(x: np.ndarray, y: np.ndarray) -> ArrayDataset:
    x = np.ascontiguousarray(x, dtype=np.float32)
    return ArrayDataset(torch.from_numpy(x), torch.from_numpy(y.astype(np.int64)))


def _read_idx_pair(directory: Path, images: Path, labels: Path, sums: dict[str, str] | None) -> ArrayDataset:
    if sums is not None:
        for path in (images, labels):
            verify(directory, path, sums)
    x, y = read_idx(images), read_idx(labels)
    if x.dtype != np.uint8 or x.ndim != 3 or x.shape[1:] != IMAGE_SHAPE[1:]:
        raise DataError(f"{images}: expected uint8 images of shape (N, 28, 28), got {x.dtype} {x.shape}")
    if y.dtype != np.uint8 or y.ndim != 1:
        raise DataError(f"{labels}: expected a 1-d uint8 label file, got {y.dtype} {y.shape}")
    if len(x) != len(y):
        raise DataError(f"{images} has {len(x)} images but {labels} has {len(y)} labels")
    if len(y) and y.max() >= 10:
        raise DataError(f"{labels}: label {int(y.max())} is outside 0..9")
    images_t = torch.from_numpy(x.reshape(len(x), *IMAGE_SHAPE).astype(np.float32)).div_(255.0)
    return ArrayDataset(images_t, torch.from_numpy(y.astype(np.int64)))


def _find_idx(directory: Path, dataset: str) -> list[Path]:
    expected = f"expected {IDX_SOURCES[dataset]}: {', '.join(f + '.gz' for f in IDX_FILES)} (gzipped or not)"
    if not directory.is_dir():
        raise DataError(f"data.dir '{directory}' does not exist or is not a folder; {expected}")
    found = []
    for stem in IDX_FILES:
        path = next((p for p in (directory / f"{stem}.gz", directory / stem) if p.is_file()), None)
        if path is None:
            raise DataError(f"data.dir '{directory}' has no {stem}(.gz); {expected}")
        found.append(path)
    return found


def _load_idx(cfg: DataConfig, directory: Path) -> tuple[ArrayDataset, ArrayDataset]:
    train_x, train_y, test_x, test_y = _find_idx(directory, cfg.dataset)
    sums = read_checksums(directory) if cfg.verify_checksums else None
    return (
        _read_idx_pair(directory, train_x, train_y, sums),
        _read_idx_pair(directory, test_x, test_y, sums),
    )


def _leaf_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise DataError(f"data.dir '{directory}' does not exist or is not a folder; expected {LEAF_SOURCE}")
    files = []
    for split in ("train", "test"):
        found = sorted((directory / split).glob("*.json"))
        if not found:
            raise DataError(f"data.dir '{directory}' has no {split}/*.json; expected {LEAF_SOURCE}")
        files += found
    return files


def _femnist_arrays(users: UserData, writers: list[str], what: str) -> tuple[np.ndarray, np.ndarray]:
    """The kept writers' samples, concatenated in writer order (a writer may lack a test split)."""
    xs, ys = [np.zeros((0, 784), np.float32)], [np.zeros(0, np.int64)]
    for w in writers:
        if w not in users:
            continue
        x, y = users[w]
        if x.shape[1] != 784:
            raise DataError(f"FEMNIST {what} writer {w!r}: rows have {x.shape[1]} values, expected 784 (28x28)")
        if len(y) and (y.min() < 0 or y.max() >= FEMNIST_CLASSES):
            raise DataError(f"FEMNIST {what} writer {w!r}: labels span {int(y.min())}..{int(y.max())}, expected 0..61")
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


def _load_femnist(cfg: DataConfig, directory: Path) -> tuple[ArrayDataset, ArrayDataset, list[np.ndarray]]:
    files = _leaf_files(directory)
    if cfg.verify_checksums:
        sums = read_checksums(directory)
        for path in files:
            verify(directory, path, sums)
    train_users, test_users = read_split(directory / "train"), read_split(directory / "test")
    writers = sorted(train_users)
    if cfg.max_clients > 0:
        writers = writers[: cfg.max_clients]
    x, y = _femnist_arrays(train_users, writers, "train")
    tx, ty = _femnist_arrays(test_users, writers, "test")
    bounds = np.cumsum([0] + [len(train_users[w][1]) for w in writers])
    natural = [np.arange(a, b, dtype=np.int64) for a, b in zip(bounds[:-1], bounds[1:])]
    shape = (-1, *IMAGE_SHAPE)
    return _tensors(x.reshape(shape), y), _tensors(tx.reshape(shape), ty), natural


def _make_synthetic(
    cfg: DataConfig, num_clients: int, rng: np.random.Generator
) -> tuple[ArrayDataset, ArrayDataset, list[np.ndarray]]:
    devices = synthetic.generate(num_clients, cfg.synthetic_alpha, cfg.synthetic_beta, cfg.synthetic_iid, rng)
    train, test = [], []
    for x, y in devices:
        n_test = min(len(y) - 1, max(1, round(len(y) * cfg.test_fraction)))
        train.append((x[n_test:], y[n_test:]))
        test.append((x[:n_test], y[:n_test]))
    bounds = np.cumsum([0] + [len(y) for _, y in train])
    natural = [np.arange(a, b, dtype=np.int64) for a, b in zip(bounds[:-1], bounds[1:])]
    return (
        _tensors(np.concatenate([x for x, _ in train]), np.concatenate([y for _, y in train])),
        _tensors(np.concatenate([x for x, _ in test]), np.concatenate([y for _, y in test])),
        natural,
    )


# --- partition -----------------------------------------------------------------------


def _split(cfg: DataConfig, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    if cfg.partition == "iid":
        return partition.iid(len(labels), num_clients, rng)
    if cfg.partition == "dirichlet":
        return partition.dirichlet(labels, num_clients, cfg.dirichlet_alpha, rng)
    if cfg.partition == "shards":
        return partition.shards(labels, num_clients, cfg.shards_per_client, cfg.shard_size, rng)
    raise ConfigError(f"data.partition = {cfg.partition!r} is not one of 'natural', 'iid', 'dirichlet', 'shards'")


def _keep_used(train: ArrayDataset, parts: list[np.ndarray]) -> tuple[ArrayDataset, list[np.ndarray]]:
    """Drop samples no client got (shards can leave some) so every train index has one owner."""
    used = np.sort(np.concatenate(parts))
    if len(used) == len(train):
        return train, parts
    log.info("partition uses %d of %d training samples; the rest belong to no client", len(used), len(train))
    idx = torch.from_numpy(used)
    return ArrayDataset(train.x[idx], train.y[idx]), [np.searchsorted(used, p).astype(np.int64) for p in parts]


def model_io(cfg: DataConfig) -> tuple[tuple[int, ...], int]:
    """(input shape, number of classes) of a dataset, without loading it."""
    if cfg.dataset == "synthetic":
        return (synthetic.DIMENSION,), synthetic.NUM_CLASSES
    return IMAGE_SHAPE, FEMNIST_CLASSES if cfg.dataset == "femnist" else 10


def load_federated(cfg: DataConfig, num_clients: int, seed: int) -> FederatedData:
    """The dataset of ``cfg`` split into clients, the same for the same config and seed.

    ``partition = "natural"`` keeps the dataset's own clients (a synthetic device, a
    FEMNIST writer); iid, dirichlet and shards re-split the pooled training set into
    ``num_clients`` clients. FEMNIST's natural split has one client per kept writer,
    whatever ``num_clients`` says.
    """
    cfg.validate()
    start = time.perf_counter()
    data_rng, split_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    natural: list[np.ndarray] | None = None
    input_shape: tuple[int, ...]
    if cfg.dataset == "synthetic":
        train, test, natural = _make_synthetic(cfg, num_clients, data_rng)
        input_shape, num_classes = (synthetic.DIMENSION,), synthetic.NUM_CLASSES
    elif cfg.dataset == "femnist":
        train, test, natural = _load_femnist(cfg, Path(cfg.dir).expanduser())
        input_shape, num_classes = IMAGE_SHAPE, FEMNIST_CLASSES
    else:
        if cfg.partition == "natural":
            raise ConfigError(
                f"data.partition = 'natural' needs a dataset with its own clients (synthetic devices, "
                f"femnist writers); {cfg.dataset} has none: use iid, dirichlet or shards"
            )
        train, test = _load_idx(cfg, Path(cfg.dir).expanduser())
        input_shape, num_classes = IMAGE_SHAPE, 10
    if cfg.partition == "natural":
        assert natural is not None  # datasets without their own clients were refused above
        parts = natural
    else:
        train, parts = _keep_used(train, _split(cfg, train.y.numpy(), num_clients, split_rng))
    log.info(
        "%s: %d clients, %d train / %d test samples, loaded and split in %.2f s",
        cfg.dataset,
        len(parts),
        len(train),
        len(test),
        time.perf_counter() - start,
    )
    return FederatedData(cfg.dataset, train, test, parts, input_shape, num_classes)
