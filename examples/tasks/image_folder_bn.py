"""Your own task, example 3: a CNN with BatchNorm on folders of PNG images, one folder per node.

Each node holds its own images in class subfolders (``cat/001.png``, ``dog/002.png``, ... as
torchvision's ImageFolder reads them; read here with PIL and numpy, no torchvision needed).
The data are a torch ``Dataset`` that opens each file when the DataLoader asks for it, so
shoal trains through a DataLoader instead of holding tensors: the path for data that do
not fit in memory.

Every node's pictures look different (its own colours, as different cameras or scanners
would give): a feature shift that BatchNorm statistics capture. The task arg
``exchange_buffers`` says what happens to them: True averages BatchNorm's running mean
and variance with the weights (FedAvg); False keeps them on each client (FedBN, Li et
al. 2021: here the statistics stay local, BatchNorm's scale and shift are averaged).

Run it (from the repository root)::

    shoal simulate --task examples/tasks/image_folder_bn.py:task --set simulation.rounds=10
    shoal simulate --task examples/tasks/image_folder_bn.py:task --set 'task.args={exchange_buffers = false}'
    python examples/tasks/image_folder_bn.py write-pngs /tmp/nodes --nodes 3   # one folder per node
    shoal client ... --task examples/tasks/image_folder_bn.py:task --data /tmp/nodes/node-0

The simulation needs no download: it draws small pictures of four shapes (circle, square,
triangle, cross) at random places and sizes, in each client's own colours, from the seed.

Task arguments (``[task.args]``): ``exchange_buffers`` (True), ``size`` (16: images are
read as size x size RGB, resized if they differ), ``images`` (64 training images per
simulated client, plus a quarter as many test images), ``channels`` (8).

``--data PATH`` format (``local_data``): a folder with ``train/`` and optionally ``test/``,
each holding one subfolder per class named as in ``CLASSES`` (``circle``, ``square``,
``triangle``, ``cross``) with ``.png`` files inside; or a folder with the class subfolders
directly (training images only). Not every class must be present on every node, but a
subfolder with another name is an error (the class ids must mean the same on every node).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import ConcatDataset, Dataset

from shoal.task import LocalData, SimulationData, Task, TaskError

try:
    from PIL import Image  # Pillow comes with matplotlib, one of shoal's dependencies
except ImportError:  # pragma: no cover - only on an install without matplotlib
    Image = None

CLASSES = ("circle", "square", "triangle", "cross")


def to_tensor(rgb: np.ndarray) -> torch.Tensor:
    """An (H, W, 3) uint8 picture -> a (3, H, W) float tensor in [-1, 1]."""
    return torch.from_numpy(rgb).permute(2, 0, 1).float().div(127.5).sub(1.0)


class PngFolder(Dataset):
    """Images in class subfolders, read from disk one at a time (like torchvision's ImageFolder)."""

    def __init__(self, root: Path, size: int):
        if Image is None:
            raise TaskError("image_folder_bn: reading PNG files needs Pillow (pip install pillow)")
        self.size = size
        self.items: list[tuple[Path, int]] = []
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            if folder.name not in CLASSES:
                raise TaskError(
                    f"image_folder_bn: {folder} is not a class of this task; class folders are {', '.join(CLASSES)}"
                )
            label = CLASSES.index(folder.name)
            self.items += [(f, label) for f in sorted(folder.iterdir()) if f.suffix.lower() == ".png"]
        if not self.items:
            raise TaskError(
                f"image_folder_bn: no .png file in class subfolders of {root} "
                f"(expected {root}/<class>/*.png, classes {', '.join(CLASSES)})"
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.items[i]
        try:
            with Image.open(path) as img:
                img = img.convert("RGB")
                if img.size != (self.size, self.size):
                    img = img.resize((self.size, self.size), Image.BILINEAR)
                rgb = np.array(img, dtype=np.uint8)  # a writable copy for torch
        except (OSError, ValueError) as e:
            raise TaskError(f"image_folder_bn: cannot read image {path}: {e}") from None
        return to_tensor(rgb), label


class PictureArrays(Dataset):
    """Generated pictures held in memory, served one at a time like the files (same transform)."""

    def __init__(self, pictures: np.ndarray, labels: np.ndarray):
        self.pictures, self.labels = pictures, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return to_tensor(self.pictures[i]), int(self.labels[i])


def draw_shapes(
    n: int, size: int, rng: np.random.Generator, fg: np.ndarray, bg: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` pictures (uint8, (n, size, size, 3)) of random shapes in colours fg on bg, and their labels."""
    labels = rng.integers(0, len(CLASSES), n)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    pictures = np.empty((n, size, size, 3), np.uint8)
    for k, label in enumerate(labels):
        r = rng.uniform(0.2, 0.35) * size
        cx, cy = rng.uniform(r, size - r, 2)
        dx, dy = xx - cx, yy - cy
        mask = {
            "circle": dx**2 + dy**2 <= r**2,
            "square": (abs(dx) <= 0.8 * r) & (abs(dy) <= 0.8 * r),
            "triangle": (dy <= r) & (dy >= -r) & (abs(dx) <= (dy + r) / 2),
            "cross": ((abs(dx) <= r / 3) & (abs(dy) <= r)) | ((abs(dy) <= r / 3) & (abs(dx) <= r)),
        }[CLASSES[label]]
        img = np.where(mask[..., None], fg, bg) + rng.normal(0, 0.08, (size, size, 3))
        pictures[k] = np.clip(img * 255, 0, 255).astype(np.uint8)
    return pictures, labels


def client_colours(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A client's own foreground and background colours (RGB in [0, 1], clearly apart)."""
    dark = rng.uniform(0.0, 0.5, 3)
    light = np.clip(dark + rng.uniform(0.3, 0.5) + rng.uniform(-0.1, 0.1, 3), 0, 1)
    return (light, dark) if rng.random() < 0.5 else (dark, light)  # light shapes on dark, or the reverse


class ImageFolderBN(Task):
    num_classes = len(CLASSES)

    def __init__(self, exchange_buffers: bool = True, size: int = 16, images: int = 64, channels: int = 8):
        if size % 4 or size < 8:
            raise TaskError(f"image_folder_bn: size = {size} must be a multiple of 4, at least 8 (two 2x2 poolings)")
        if not isinstance(exchange_buffers, bool):
            raise TaskError(f"image_folder_bn: exchange_buffers = {exchange_buffers!r} must be true or false")
        self.exchange_buffers = exchange_buffers  # False: FedBN, BatchNorm statistics stay on each client
        self.size, self.images, self.channels = size, images, channels

    def describe(self) -> str:
        return f"image folder CNN+BN ({'FedAvg of BN stats' if self.exchange_buffers else 'FedBN'})"

    def model(self) -> nn.Module:
        c = self.channels
        return nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1),
            nn.BatchNorm2d(2 * c),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * c * (self.size // 4) ** 2, len(CLASSES)),
        )

    # The default loss (cross-entropy) and metrics (loss, accuracy) fit a classifier: not overridden.

    def simulation_data(self, num_clients: int, seed: int) -> SimulationData:
        rng = np.random.default_rng(seed)
        train, tests = [], []
        for _ in range(num_clients):
            fg, bg = client_colours(rng)
            train.append(PictureArrays(*draw_shapes(self.images, self.size, rng, fg, bg)))
            tests.append(PictureArrays(*draw_shapes(max(1, self.images // 4), self.size, rng, fg, bg)))
        # A central test set mixes every client's colours. With FedBN (exchange_buffers False)
        # no single set of BatchNorm statistics belongs to it, so only the clients evaluate
        # (fed_* metrics, each with its own statistics).
        central = ConcatDataset(tests) if self.exchange_buffers else None
        return SimulationData(train=train, test=central, client_test=tests)

    def local_data(self, path: Path) -> LocalData:
        path = Path(path)
        if not path.is_dir():
            raise TaskError(
                f"image_folder_bn: --data {str(path)!r} is not a folder; give a folder with train/ "
                "(and optionally test/) holding one subfolder of .png files per class"
            )
        if (path / "train").is_dir():
            test = PngFolder(path / "test", self.size) if (path / "test").is_dir() else None
            return LocalData(train=PngFolder(path / "train", self.size), test=test)
        return LocalData(train=PngFolder(path, self.size))


task = ImageFolderBN


def write_pngs(out: Path, nodes: int, seed: int = 0, size: int = 16, images: int = 64) -> list[Path]:
    """``out/node-<i>/{train,test}/<class>/<k>.png``: the simulation's clients as image folders."""
    if Image is None:
        raise SystemExit("error: writing PNG files needs Pillow (pip install pillow)")
    data = ImageFolderBN(size=size, images=images).simulation_data(nodes, seed)
    folders = []
    for i, (train, test) in enumerate(zip(data.train, data.client_test)):
        node = out / f"node-{i}"
        for split, arrays in (("train", train), ("test", test)):
            for k, (picture, label) in enumerate(zip(arrays.pictures, arrays.labels)):
                folder = node / split / CLASSES[int(label)]
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(picture).save(folder / f"{k:05d}.png")
        folders.append(node)
    return folders


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write per-node PNG folders for shoal client/peer --data.")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write-pngs", help="DIR/node-<i>/{train,test}/<class>/*.png")
    w.add_argument("out", type=Path)
    w.add_argument("--nodes", type=int, default=3)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--size", type=int, default=16)
    w.add_argument("--images", type=int, default=64)
    args = parser.parse_args()
    for folder in write_pngs(args.out, args.nodes, args.seed, args.size, args.images):
        print(folder)
