"""Insiders (bench/fuzz_server.py --insiders, tests/server/insider_fuzz.py): a node without a task
opening chunked uploads, an edge claiming names that are no enrolled node or sending partials for
nodes it does not hold, a node acting as an edge, each credential on another role's routes, and a
researcher naming unregistered tasks, configs below the floors and another researcher's runs:
no 5xx, nothing accepted, nothing changed."""

from __future__ import annotations

import asyncio

import pytest

from .insider_fuzz import fuzz, insider_federation


@pytest.mark.timeout(120)
def test_insiders_beyond_their_role_get_4xx_and_change_nothing(tmp_path):
    async def main():
        async with insider_federation(tmp_path) as ins:
            return await fuzz(ins, batches=1, batch=300, seed=1)

    figures = asyncio.run(main())
    for category, f in figures.items():
        assert f.requests == 50, category  # 300 requests, the six categories in turn
        assert (f.five_xx, f.accepted, f.state_changed) == (0, 0, 0), (category, f.examples)
