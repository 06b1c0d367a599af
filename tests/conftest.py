"""Shared test fixtures: where ../shared/datasets lives, small configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

REPO = Path(__file__).resolve().parents[1]
DATASETS = REPO.parent / "shared" / "datasets"


def dataset_dir(name: str) -> Path:
    path = DATASETS / name
    if not path.is_dir():
        pytest.skip(f"{path} not present (the shared datasets sit beside the checkout)")
    return path


@pytest.fixture
def mnist_dir() -> Path:
    return dataset_dir("mnist-reconstructed")


@pytest.fixture
def femnist_dir() -> Path:
    return dataset_dir("femnist-leaf")
