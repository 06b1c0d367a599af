"""Every example config in examples/ loads and validates (data.dir set where a dataset needs one)."""

import pytest

from shoal.config import load_config

from ..conftest import REPO


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.toml")), ids=lambda p: p.name)
def test_example_config_loads(path):
    cfg = load_config(path, ['data.dir="/nonexistent"'])
    assert cfg.simulation.rounds >= 1
