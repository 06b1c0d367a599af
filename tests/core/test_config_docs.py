"""docs/config.md is what shoal/config/docs.py generates from the config dataclasses, and it
documents every key of every section (type, default, allowed values, what it does)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shoal.config import Config
from shoal.config.docs import render, section_keys

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"


@pytest.mark.slow
def test_the_page_is_the_generated_one():
    assert PAGE.read_text() == render(), (
        "docs/config.md is stale: regenerate it with `python -m shoal.config.docs > docs/config.md`"
    )


@pytest.mark.slow
def test_every_key_of_every_section_has_a_row_with_what_it_does():
    page = PAGE.read_text()
    for section in dataclasses.fields(Config):
        assert f"## [{section.name}]" in page
        rows = {k.name: k for k in section_keys(section.name)}
        names = [f.name for f in dataclasses.fields(getattr(Config(), section.name))]
        assert list(rows) == names
        for name, row in rows.items():
            assert row.doc, f"{section.name}.{name} has no comment in shoal/config/: say what it does"
            assert f"| `{name}` | {row.type} | `{row.default}` |" in page


def test_rows_carry_types_defaults_choices_and_ranges_read_from_the_code():
    rows = {k.name: k for k in section_keys("server")}
    assert (rows["port"].type, rows["port"].default, rows["port"].allowed) == ("int", "8443", "in 1..65535")
    assert rows["mode"].allowed == '"sync", "async"' and rows["mode"].default == '"sync"'
    assert rows["fraction"].allowed == "in (0, 1]" and rows["ingest_slots"].allowed == "> 0"
    assert rows["upload_timeout_s"].allowed.startswith("a finite number of seconds > 0")  # from a loop over keys
    sa = {k.name: k for k in section_keys("secure_aggregation")}
    assert sa["dropout_unmask"].allowed == "in [0, 1]" and sa["threshold"].allowed == "in [0.5, 1)"
    privacy = {k.name: k for k in section_keys("privacy")}
    assert privacy["sampling"].doc.startswith("central/distributed: how a round picks clients")  # the block above
    assert privacy["sweep_modes"].type == "list of string"
    gossip = {k.name: k for k in section_keys("gossip")}
    assert gossip["group_size"].doc.endswith("(the virtual grid's side)")  # the comment line below it
