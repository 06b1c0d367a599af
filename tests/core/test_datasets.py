"""Data layer: synthetic generator, idx and LEAF readers, checksums, and the real datasets."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from shoal import synthetic
from shoal.config import DataConfig
from shoal.datasets import (
    IDX_FILES,
    FederatedData,
    load_federated,
    read_checksums,
    sha256_of,
)
from shoal.errors import ConfigError, DataError
from shoal.idx import parse_idx, read_idx, write_idx

DATASETS = Path(__file__).parents[2].parent / "shared" / "datasets"


def _real(name: str) -> Path:
    path = DATASETS / name
    if not path.is_dir():
        pytest.skip(f"shared dataset folder {path} is absent (see ../shared/datasets/README.md)")
    return path


def _check_federated(fd: FederatedData) -> None:
    """The invariants every FederatedData keeps."""
    n = len(fd.train)
    assert fd.train.x.dtype == torch.float32 and fd.train.y.dtype == torch.int64
    assert fd.test.x.dtype == torch.float32 and fd.test.y.dtype == torch.int64
    assert tuple(fd.train.x.shape) == (n, *fd.input_shape)
    assert tuple(fd.test.x.shape[1:]) == fd.input_shape
    allidx = np.concatenate(fd.client_indices)
    assert all(p.dtype == np.int64 for p in fd.client_indices)
    assert np.array_equal(np.sort(allidx), np.arange(n)), "every train index in exactly one client"
    assert int(fd.train.y.max()) < fd.num_classes and int(fd.test.y.max()) < fd.num_classes
    c = fd.client(0)
    assert torch.equal(c.y, fd.train.y[torch.from_numpy(fd.client_indices[0])])
    assert len(c) == len(fd.client_indices[0])


# --- synthetic ---------------------------------------------------------------------


def test_synthetic_shapes_and_split() -> None:
    cfg = DataConfig(dataset="synthetic", partition="natural", test_fraction=0.2)
    fd = load_federated(cfg, 30, seed=0)
    _check_federated(fd)
    assert fd.name == "synthetic" and fd.input_shape == (60,) and fd.num_classes == 10
    assert fd.num_clients == 30
    sizes = np.array([len(p) for p in fd.client_indices])
    assert sizes.min() >= 40  # lognormal + 50, minus the test share
    assert sizes.max() <= synthetic.MAX_SAMPLES_PER_DEVICE
    assert len(fd.test) == pytest.approx(0.2 * (len(fd.train) + len(fd.test)), rel=0.05)
    assert len(np.unique(fd.train.y.numpy())) == 10


def test_synthetic_deterministic_per_seed() -> None:
    cfg = DataConfig(dataset="synthetic")
    a, b, c = load_federated(cfg, 10, 7), load_federated(cfg, 10, 7), load_federated(cfg, 10, 8)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)
    assert all(np.array_equal(x, y) for x, y in zip(a.client_indices, b.client_indices))
    assert not (a.train.x.shape == c.train.x.shape and torch.equal(a.train.x, c.train.x))


def test_synthetic_repartition_keeps_the_data() -> None:
    """The same seed gives the same samples whichever way they are split."""
    natural = load_federated(DataConfig(dataset="synthetic"), 20, 3)
    pooled = load_federated(DataConfig(dataset="synthetic", partition="dirichlet"), 20, 3)
    _check_federated(pooled)
    assert torch.equal(natural.train.x, pooled.train.x)


def _device_spread(alpha: float, beta: float, iid: bool) -> tuple[float, float]:
    """(std over devices of the mean input, mean total-variation of device label mix vs global)."""
    devices = synthetic.generate(50, alpha, beta, iid, np.random.default_rng(0))
    spread = float(np.std([x.mean() for x, _ in devices]))
    ys = np.concatenate([y for _, y in devices])
    glob = np.bincount(ys, minlength=10) / len(ys)
    tv = np.mean([0.5 * np.abs(np.bincount(y, minlength=10) / len(y) - glob).sum() for _, y in devices])
    return spread, float(tv)


def test_synthetic_heterogeneity_grows_with_alpha_beta() -> None:
    spread00, tv00 = _device_spread(0.0, 0.0, False)
    spread11, _ = _device_spread(1.0, 1.0, False)
    spread_iid, tv_iid = _device_spread(0.0, 0.0, True)
    # beta moves each device's inputs: v_k ~ N(B_k, 1) with B_k ~ N(0, beta).
    assert spread11 > 4 * spread00
    # The IID variant shares W, b and v = 0: inputs and label mixes alike on every device.
    assert spread_iid < spread00 / 10
    assert tv_iid < tv00 / 3


# --- idx format --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
@pytest.mark.parametrize("name", ["a-idx3-ubyte", "a-idx3-ubyte.gz"])
def test_idx_round_trip(tmp_path: Path, dtype: type, name: str) -> None:
    arr = (np.arange(2 * 3 * 4).reshape(2, 3, 4) - 7).astype(dtype)
    write_idx(tmp_path / name, arr)
    back = read_idx(tmp_path / name)
    assert back.dtype == arr.dtype and back.shape == arr.shape and np.array_equal(back, arr)


def test_idx_header_is_the_official_one(tmp_path: Path) -> None:
    write_idx(tmp_path / "x", np.zeros((5, 28, 28), np.uint8))
    raw = (tmp_path / "x").read_bytes()
    assert raw[:4] == bytes([0, 0, 0x08, 3])
    assert raw[4:16] == (5).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2


def test_idx_bad_magic(tmp_path: Path) -> None:
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01" + bytes(8))
    with pytest.raises(DataError, match="magic number"):
        read_idx(tmp_path / "bad")
    with pytest.raises(DataError, match="magic number"):
        parse_idx(bytes([0, 0, 0x42, 1, 0, 0, 0, 0]))
    with pytest.raises(DataError, match="shorter"):
        parse_idx(b"\x00")


def test_idx_truncated_and_padded(tmp_path: Path) -> None:
    write_idx(tmp_path / "x", np.ones((10, 28, 28), np.uint8))
    raw = (tmp_path / "x").read_bytes()
    (tmp_path / "short").write_bytes(raw[:-100])
    with pytest.raises(DataError, match="truncated"):
        read_idx(tmp_path / "short")
    (tmp_path / "header").write_bytes(raw[:9])
    with pytest.raises(DataError, match="truncated idx header"):
        read_idx(tmp_path / "header")
    (tmp_path / "long").write_bytes(raw + b"\x00")
    with pytest.raises(DataError, match="trailing"):
        read_idx(tmp_path / "long")
    gz = gzip.compress(raw)
    (tmp_path / "short.gz").write_bytes(gz[: len(gz) // 2])
    with pytest.raises(DataError, match="gzip"):
        read_idx(tmp_path / "short.gz")


def _fake_mnist(directory: Path, n_train: int = 300, n_test: int = 50, gz: bool = True) -> None:
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) % 10).astype(np.uint8),
    }
    for stem, arr in arrays.items():
        write_idx(directory / (stem + (".gz" if gz else "")), arr)


def _write_sums(directory: Path, names: list[str]) -> None:
    lines = [f"{hashlib.sha256((directory / n).read_bytes()).hexdigest()}  {n}" for n in names]
    (directory / "SHA256SUMS").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("gz", [True, False])
def test_idx_dataset_loads_and_partitions(tmp_path: Path, gz: bool) -> None:
    _fake_mnist(tmp_path, gz=gz)
    cfg = DataConfig(dataset="mnist", dir=str(tmp_path), partition="iid")
    fd = load_federated(cfg, 7, seed=1)
    _check_federated(fd)
    assert len(fd.train) == 300 and len(fd.test) == 50 and fd.num_clients == 7
    assert fd.input_shape == (1, 28, 28) and fd.num_classes == 10
    assert 0.0 <= float(fd.train.x.min()) and float(fd.train.x.max()) <= 1.0
    raw = read_idx(tmp_path / ("train-images-idx3-ubyte" + (".gz" if gz else "")))
    assert torch.allclose(fd.train.x[3, 0], torch.from_numpy(raw[3]).float() / 255)


def test_shards_drop_unowned_samples(tmp_path: Path) -> None:
    _fake_mnist(tmp_path)
    cfg = DataConfig(dataset="fashion-mnist", dir=str(tmp_path), partition="shards", shard_size=10)
    fd = load_federated(cfg, 5, seed=0)
    _check_federated(fd)
    assert len(fd.train) == 5 * 2 * 10
    assert all(len(np.unique(fd.client(i).y.numpy())) <= 2 for i in range(5))


def test_checksum_mismatch_names_file_expected_and_got(tmp_path: Path) -> None:
    _fake_mnist(tmp_path)
    names = [f + ".gz" for f in IDX_FILES]
    _write_sums(tmp_path, names[1:])  # train images unlisted: read without a check
    cfg = DataConfig(dataset="mnist", dir=str(tmp_path), partition="iid")
    load_federated(cfg, 3, seed=0)
    expected = read_checksums(tmp_path)["t10k-labels-idx1-ubyte.gz"]
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.full(50, 3, np.uint8))
    got = hashlib.sha256((tmp_path / "t10k-labels-idx1-ubyte.gz").read_bytes()).hexdigest()
    with pytest.raises(DataError) as err:
        load_federated(cfg, 3, seed=0)
    msg = str(err.value)
    assert "t10k-labels-idx1-ubyte.gz" in msg and expected in msg and got in msg
    cfg.verify_checksums = False
    load_federated(cfg, 3, seed=0)


def test_malformed_checksum_file(tmp_path: Path) -> None:
    (tmp_path / "SHA256SUMS").write_text("nothex  file\n")
    with pytest.raises(DataError, match="SHA256SUMS:1"):
        read_checksums(tmp_path)


def test_sha256_recomputed_when_file_changes(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"one")
    first = sha256_of(f)
    assert first == hashlib.sha256(b"one").hexdigest()
    f.write_bytes(b"two!")
    os.utime(f, ns=(1, 1))  # a new mtime and size: the cache must not answer
    assert sha256_of(f) == hashlib.sha256(b"two!").hexdigest()


def test_missing_directory_says_what_and_where(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError) as err:
        load_federated(DataConfig(dataset="mnist", dir=str(missing), partition="iid"), 10, 0)
    msg = str(err.value)
    assert str(missing) in msg and "MNIST" in msg
    assert all(f + ".gz" in msg for f in IDX_FILES)
    assert "\n" not in msg
    with pytest.raises(DataError, match="Fashion-MNIST"):
        load_federated(DataConfig(dataset="fashion-mnist", dir=str(missing), partition="iid"), 10, 0)
    with pytest.raises(DataError, match="LEAF"):
        load_federated(DataConfig(dataset="femnist", dir=str(missing)), 10, 0)


def test_missing_file_is_named(tmp_path: Path) -> None:
    _fake_mnist(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte.gz").unlink()
    with pytest.raises(DataError, match=r"has no t10k-images-idx3-ubyte\(\.gz\)"):
        load_federated(DataConfig(dataset="mnist", dir=str(tmp_path), partition="iid"), 10, 0)


def test_natural_partition_needs_natural_clients(tmp_path: Path) -> None:
    _fake_mnist(tmp_path)
    with pytest.raises(ConfigError, match="data.partition"):
        load_federated(DataConfig(dataset="mnist", dir=str(tmp_path), partition="natural"), 10, 0)


def test_label_count_mismatch(tmp_path: Path) -> None:
    _fake_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(299, np.uint8))
    with pytest.raises(DataError, match="labels"):
        load_federated(DataConfig(dataset="mnist", dir=str(tmp_path), partition="iid"), 10, 0)


# --- LEAF JSON ---------------------------------------------------------------------


def _fake_leaf(directory: Path, writers: dict[str, tuple[int, int]]) -> None:
    """writers: name -> (train samples, test samples); two files per split."""
    rng = np.random.default_rng(0)
    for split, col in (("train", 0), ("test", 1)):
        (directory / split).mkdir(parents=True)
        names = sorted(writers)
        for part, chunk in enumerate((names[::2], names[1::2])):
            doc = {"users": chunk, "num_samples": [writers[w][col] for w in chunk], "user_data": {}}
            for w in chunk:
                n = writers[w][col]
                doc["user_data"][w] = {
                    "x": rng.random((n, 784)).round(3).tolist(),
                    "y": rng.integers(0, 62, n).tolist(),
                }
            (directory / split / f"all_data_{part}.json").write_text(json.dumps(doc))


def test_leaf_natural_one_client_per_writer(tmp_path: Path) -> None:
    writers = {"f0003": (5, 1), "f0001": (3, 2), "f0002": (4, 1)}
    _fake_leaf(tmp_path, writers)
    fd = load_federated(DataConfig(dataset="femnist", dir=str(tmp_path)), 99, 0)
    _check_federated(fd)
    assert fd.input_shape == (1, 28, 28) and fd.num_classes == 62
    assert [len(p) for p in fd.client_indices] == [3, 4, 5]  # sorted writer order
    assert len(fd.test) == 4
    two = load_federated(DataConfig(dataset="femnist", dir=str(tmp_path), max_clients=2), 99, 0)
    assert [len(p) for p in two.client_indices] == [3, 4] and len(two.test) == 3
    pooled = load_federated(DataConfig(dataset="femnist", dir=str(tmp_path), partition="iid"), 4, 0)
    _check_federated(pooled)
    assert pooled.num_clients == 4 and len(pooled.train) == 12


def test_leaf_inconsistent_counts(tmp_path: Path) -> None:
    _fake_leaf(tmp_path, {"a": (3, 1), "b": (2, 1)})
    path = tmp_path / "train" / "all_data_0.json"
    doc = json.loads(path.read_text())
    doc["num_samples"][0] += 1
    path.write_text(json.dumps(doc))
    with pytest.raises(DataError, match="num_samples"):
        load_federated(DataConfig(dataset="femnist", dir=str(tmp_path)), 1, 0)


def test_leaf_missing_split_folder(tmp_path: Path) -> None:
    _fake_leaf(tmp_path, {"a": (3, 1)})
    shutil.rmtree(tmp_path / "test")
    with pytest.raises(DataError, match=r"test/\*\.json.*LEAF"):
        load_federated(DataConfig(dataset="femnist", dir=str(tmp_path)), 1, 0)


def test_leaf_checksums_use_relative_paths(tmp_path: Path) -> None:
    _fake_leaf(tmp_path, {"a": (3, 1)})
    _write_sums(tmp_path, ["train/all_data_0.json", "test/all_data_0.json"])
    load_federated(DataConfig(dataset="femnist", dir=str(tmp_path)), 1, 0)
    (tmp_path / "test" / "all_data_0.json").write_text((tmp_path / "test" / "all_data_0.json").read_text() + " ")
    with pytest.raises(DataError, match="test/all_data_0.json: sha256 mismatch"):
        load_federated(DataConfig(dataset="femnist", dir=str(tmp_path)), 1, 0)


# --- the real datasets in ../shared/datasets ---------------------------------------------


@pytest.fixture(scope="module")
def mnist() -> FederatedData:
    cfg = DataConfig(dataset="mnist", dir=str(_real("mnist-reconstructed")), partition="shards")
    return load_federated(cfg, 100, seed=0)


def test_real_mnist(mnist: FederatedData) -> None:
    # shards of 300, 2 per client, 100 clients: McMahan's split covers all 60,000.
    assert len(mnist.train) == 60000 and len(mnist.test) == 10000
    _check_federated(mnist)
    assert set(np.unique(mnist.train.y.numpy())) == set(range(10))
    assert set(np.unique(mnist.test.y.numpy())) == set(range(10))
    # MNIST's class sizes are not multiples of 300, so a few shards straddle two digits.
    distinct = [len(np.unique(mnist.client(i).y.numpy())) for i in range(100)]
    assert max(distinct) <= 4 and np.mean(distinct) < 2.3
    assert 0.0 == float(mnist.train.x.min()) and float(mnist.train.x.max()) == 1.0


def test_real_mnist_checksums_listed_files() -> None:
    directory = _real("mnist-reconstructed")
    sums = read_checksums(directory)
    # The official test images, test labels and train labels are byte-exact and listed.
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", "train-labels-idx1-ubyte.gz"):
        assert sha256_of(directory / name) == sums[name]
    for name, digest in sums.items():
        assert sha256_of(directory / name) == digest


def test_real_fashion_mnist() -> None:
    directory = _real("fashion-mnist")
    sums = read_checksums(directory)
    assert sorted(sums) == sorted(f + ".gz" for f in IDX_FILES)  # every file is checked
    fd = load_federated(DataConfig(dataset="fashion-mnist", dir=str(directory), partition="dirichlet"), 20, 0)
    assert len(fd.train) == 60000 and len(fd.test) == 10000
    _check_federated(fd)
    assert set(np.unique(fd.test.y.numpy())) == set(range(10))


@pytest.mark.slow
def test_real_femnist() -> None:
    fd = load_federated(DataConfig(dataset="femnist", dir=str(_real("femnist-leaf"))), 30, 0)
    assert fd.num_clients == 105
    assert len(fd.train) == 14708 and len(fd.test) == 1685
    _check_federated(fd)
    assert fd.num_classes == 62 and int(fd.train.y.max()) <= 61
    assert len(np.unique(fd.train.y.numpy())) == 62
    assert 0.0 <= float(fd.train.x.min()) and float(fd.train.x.max()) <= 1.0
