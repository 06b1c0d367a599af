"""`shoal node` with a list of servers: a daemon whose first server is gone moves to the next after
two failed requests in a row, joins the run offered there and trains it to the end; each run's node
gets the same list (on the run's routes). The node config takes a list, or URLs comma-separated;
bad lists are refused with the key named."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from shoal.client.daemon import NodeDaemon
from shoal.client.node_config import load_node_config, source_sha256
from shoal.errors import ConfigError
from tests.hierarchy.deploy import free_port
from tests.server.federation_live import live_federation
from tests.server.task_files import write_node_data

NODES = ["n0", "n1"]

NODE_TOML = """
[node]
server = {servers}
token_file = "{token_file}"
name = "{name}"
device = "cpu"
state_dir = "{state}"
poll_s = 0.3

[[tasks]]
ref = "{ref}"
sha256 = "{sha}"
data = "{data}"
"""


@pytest.mark.timeout(120)
def test_a_daemon_whose_first_server_is_gone_reattaches_and_takes_part(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="shoal.client.daemon")

    async def main():
        async with live_federation(tmp_path, NODES) as f:
            gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
            daemons = []
            for i, name in enumerate(NODES):
                toml = tmp_path / f"{name}.toml"
                servers = f'["{gone}", "{f.url}"]' if i == 0 else f'"{gone},{f.url}"'  # a list, or comma-separated
                toml.write_text(
                    NODE_TOML.format(
                        servers=servers,
                        token_file=tmp_path / f"{name}.token",
                        name=name,
                        state=tmp_path / f"{name}-state",
                        ref=f.task_ref,
                        sha=source_sha256(f.task_ref),
                        data=write_node_data(tmp_path / f"{name}.pt", seed=i + 1),
                    )
                )
                cfg = load_node_config(toml)
                assert cfg.servers == [gone, f.url] and cfg.server == gone
                assert cfg.token_file is not None
                daemon = NodeDaemon(cfg, cfg.token_file.read_text().strip(), torch.device("cpu"), None)
                f.daemons[name] = daemon
                f.runners[name] = asyncio.ensure_future(daemon.run())
                daemons.append(daemon)
            run = await f.submit(
                {
                    "simulation": {"seed": 5},
                    "train": {"batch_size": 16, "lr": 0.05},
                    "server": {"rounds": 2, "min_nodes": 2, "deadline_s": 20.0, "poll_s": 1.0, "eval": False},
                }
            )
            status = await f.wait_ended(run, 90)
            assert status["status"] == "finished", status
            assert all(d.url == f.url for d in daemons)
            assert all(run in d.runs for d in daemons)

    asyncio.run(main())
    moved = [r.getMessage() for r in caplog.records if "re-attaching to" in r.getMessage()]
    attached = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attached to")]
    assert len(moved) == len(NODES) and len(attached) == len(NODES), caplog.text


def test_the_node_config_checks_its_list_of_servers(tmp_path) -> None:
    def load(servers: str):
        toml = tmp_path / "n.toml"
        toml.write_text(f'[node]\nserver = {servers}\nname = "n"\ntoken_file = "t"\n')
        return load_node_config(toml)

    assert load('"https://a:1/, https://b:2"').servers == ["https://a:1", "https://b:2"]
    assert load('"https://a:1"').servers == ["https://a:1"]
    for bad, words in (
        ('["https://a:1", "http://b:2"]', "must start with https://"),
        ('"https://a:1,https://a:1"', "twice"),
        ("[1, 2]", "list of URLs"),
        ('""', "names 0 servers"),
        ('"a:1"', "must start with https://"),
    ):
        with pytest.raises(ConfigError) as e:
            load(bad)
        assert "node.server" in str(e.value) and words in str(e.value), e.value
