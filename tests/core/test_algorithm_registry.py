"""The algorithm registry (shoal/algorithms.py) is what the code and docs/algorithms.md read: its
tables are the generated ones, each entry names a client program of its own name, and the config's
refusals are the entries' declarations."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from shoal.algorithms import ALGORITHMS, AlgorithmName, algorithm, render
from shoal.client.algorithms import program_classes
from shoal.config import config_from_dict
from shoal.errors import ConfigError

PAGE = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


def test_the_page_carries_the_generated_tables():
    assert render() in PAGE.read_text(), (
        "docs/algorithms.md is stale: paste the output of `python -m shoal.algorithms` between its markers"
    )


def test_each_entry_is_a_config_choice_and_names_a_program_of_its_name():
    assert typing.get_args(AlgorithmName) == tuple(ALGORITHMS)
    programs = program_classes()
    for name, declared in ALGORITHMS.items():
        assert programs[declared.program].name == name
    with pytest.raises(KeyError, match="known: fedavg"):
        algorithm("fedsgd")


@pytest.mark.parametrize(
    ("name", "settings", "why"),
    [
        ("scaffold", {"privacy": {"mode": "central", "noise_multiplier": 1.0}}, "second release"),
        ("fednova", {"train": {"prox_mu": 0.1}}, "normaliser here is that of SGD"),
        ("feddyn", {"robust": {"rule": "median"}}, "defined on the mean"),
        ("ditto", {"simulation": {"mode": "async"}}, "simulation.mode = 'async'"),
    ],
)
def test_refusals_come_from_the_declarations(name, settings, why):
    with pytest.raises(ConfigError, match=f"algorithm.name = '{name}' with .*{why}"):
        config_from_dict({"algorithm": {"name": name}, **settings}).validate()
    assert config_from_dict({"algorithm": {"name": "fedavg"}, **settings}).validate().algorithm.name == "fedavg"
