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


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test`: --dist loadgroup) the tests of a module that share a
    module- or class-scoped fixture run on one worker, so the fixture (a Ray cluster, a Flower
    run, a data set) is built once and not once per worker. Tests with their own xdist_group mark
    keep it."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d and d[-1].scope in ("module", "class", "package") for d in defs):
            item.add_marker(pytest.mark.xdist_group(f"module:{item.nodeid.split('::')[0]}"))
