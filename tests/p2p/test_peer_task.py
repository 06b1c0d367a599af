"""`shoal peer` with a user's task written outside the repository: three real peer processes
(HTTPS with certificates the test makes) train on their own files, exchange models and write
metrics.jsonl with the task's own metrics; peers built as `shoal peer` builds them, in one event
loop (tests/p2p/network.py), report central and own metrics with ``--data client:<i>`` and
refuse a peer running a different model by spec hash; a bad ``--data`` path is one clear line.
Every wait is bounded and every process is stopped by the test."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shoal.config import Config, load_config
from shoal.metrics import read_jsonl
from shoal.tls import make_private_ca

from .network import LocalNetwork
from .processes import free_ports, peer_status, start_peer, stop_peers, wait_for

TOKEN = "peer-task-token"

# A task as a user writes it from the README: a small MLP regressing y on 4 features; every
# peer reads its own CSV file (last column = y) and keeps a fifth of it as its own test data.
TASK_FILE = textwrap.dedent("""
    import numpy as np
    import torch
    from torch import nn
    from shoal.task import LocalData, SimulationData, Task

    class Regression(Task):
        def __init__(self, hidden=16):
            self.hidden = hidden
        def model(self):
            return nn.Sequential(nn.Linear(4, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 1))
        def loss(self, model, x, y):
            return ((model(x).squeeze(-1) - y) ** 2).mean()
        def metrics(self, model, x, y):
            err = ((model(x).squeeze(-1) - y) ** 2).mean()
            return {"loss": err, "y_mean": y.mean(), "y_sq": (y * y).mean()}
        def summarize(self, m):
            return {"loss": m["loss"], "r2": 1.0 - m["loss"] / (m["y_sq"] - m["y_mean"] ** 2)}
        def local_data(self, path):
            table = torch.from_numpy(np.loadtxt(path, delimiter=",", dtype=np.float32))
            x, y = table[:, :4], table[:, 4]
            cut = int(0.8 * len(y))
            return LocalData(train=(x[:cut], y[:cut]), test=(x[cut:], y[cut:]))
        def simulation_data(self, num_clients, seed):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(num_clients * 60 + 200, 4, generator=g)
            y = x @ torch.tensor([1.0, -2.0, 0.5, 0.0]) + 0.1 * torch.randn(len(x), generator=g)
            train = [(x[i * 60:(i + 1) * 60 - 12], y[i * 60:(i + 1) * 60 - 12]) for i in range(num_clients)]
            own = [(x[(i + 1) * 60 - 12:(i + 1) * 60], y[(i + 1) * 60 - 12:(i + 1) * 60]) for i in range(num_clients)]
            return SimulationData(train=train, test=(x[-200:], y[-200:]), client_test=own)

    task = Regression
""")

CONFIG = textwrap.dedent("""
    [simulation]
    num_clients = 3
    seed = 5
    [train]
    lr = 0.05
    batch_size = 16
    [gossip]
    period = 0.3
    timeout = 5.0
    view_size = 2
    shuffle_length = 1
    max_failures = 3
""")


def _write_task(folder: Path, n_peers: int = 3) -> tuple[str, Path, list[Path]]:
    """The task file, a config, and one CSV of generated data per peer, all in ``folder``."""
    (folder / "my_task.py").write_text(TASK_FILE)
    (folder / "peer.toml").write_text(CONFIG)
    g = torch.Generator().manual_seed(11)
    w = torch.tensor([1.0, -2.0, 0.5, 0.0])
    files = []
    for i in range(n_peers):
        x = torch.randn(100, 4, generator=g) + 0.3 * i  # a slightly different input range per peer
        y = x @ w + 0.1 * torch.randn(100, generator=g)
        rows = torch.cat([x, y[:, None]], 1)
        path = folder / f"peer{i}.csv"
        path.write_text("\n".join(",".join(f"{v:.6f}" for v in row.tolist()) for row in rows) + "\n")
        files.append(path)
    return f"{folder / 'my_task.py'}:task", folder / "peer.toml", files


def _run_three(tmp_path: Path, data: list[str], tls: bool) -> tuple[list[list[dict]], list[dict]]:
    """Three peers in a line of bootstraps; run until every one has trained 5 steps and merged
    a model, stop them, return their metrics records and last statuses."""
    task, config, _ = _write_task(tmp_path)
    ports = free_ports(3)
    scheme = "https" if tls else "http"
    urls = [f"{scheme}://127.0.0.1:{p}" for p in ports]
    ctx = None
    security = ["--insecure"]
    if tls:
        pki = make_private_ca(tmp_path / "pki")
        ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
        security = ["--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--ca-cert", str(pki.ca_cert)]
    procs = []
    try:
        for i in range(3):
            args = [
                "--listen",
                f"127.0.0.1:{ports[i]}",
                "--bootstrap",
                urls[(i + 1) % 3],
                "--task",
                task,
                "-c",
                str(config),
                "--data",
                data[i],
                "--out",
                str(tmp_path / f"out{i}"),
                *security,
            ]
            procs.append(start_peer(args, TOKEN, tmp_path / f"peer{i}.log"))

        def trained():
            st = [peer_status(u, TOKEN, ctx) for u in urls]
            return st if all(s and s["steps"] >= 5 and s["merges"] >= 1 for s in st) else None

        statuses = wait_for(trained, 150, "3 peers to train 5 steps and merge", procs)
    finally:
        stop_peers(procs)
    logs = "\n".join((tmp_path / f"peer{i}.log").read_text() for i in range(3))
    assert all(p.returncode == 0 for p in procs), logs[-3000:]
    assert "Traceback" not in logs
    return [read_jsonl(tmp_path / f"out{i}" / "metrics.jsonl") for i in range(3)], statuses


@pytest.mark.timeout(240)
def test_three_peers_train_a_user_task_on_their_own_files_over_https(tmp_path):
    folder = tmp_path / "user"  # outside the repository, as a user's project would be
    folder.mkdir()
    data = [str(folder / f"peer{i}.csv") for i in range(3)]
    runs, statuses = _run_three(folder, data, tls=True)
    assert len({s["spec_hash"] for s in statuses}) == 1  # every peer built the same model
    for records, status in zip(runs, statuses):
        first, last = records[0], records[-1]
        # every metric the task gives, on the peer's own 20 test rows; no central set here
        assert {"local_test_loss", "local_test_r2", "local_test_num_examples"} <= set(last), last
        assert not any(k.startswith("test_") for k in last)
        assert last["local_test_num_examples"] == 20
        assert last["local_test_loss"] < first["local_test_loss"]
        assert last["local_test_r2"] > first["local_test_r2"]
        assert {"local_test_r2", "local_test_loss"} <= set(status["metrics"])  # GET /status shows them too
        assert last["merges"] >= 1 and last["bytes_sent"] > 0


def _cfg(task: str, config: Path, *settings: str) -> Config:
    """The config `shoal peer --task TASK -c CONFIG --set ...` loads."""
    return load_config(config, [*settings, f"task.app={json.dumps(task)}"])


async def _trained(net: LocalNetwork, steps: int, what: str) -> dict[int, dict]:
    """Wait (bounded) until every peer has trained ``steps`` steps and merged a model."""

    def done():
        st = net.statuses(range(net.n))
        return st if all(s["steps"] >= steps and s["merges"] >= 1 for s in st.values()) else None

    return await net.wait_for(done, 150, what)


@pytest.mark.timeout(240)
def test_three_peers_on_clients_of_the_task_split_report_central_and_own_metrics(tmp_path):
    """``--data client:<i>`` with a user's task (tests/p2p/network.py: three peers in one event loop)."""
    task, config, _ = _write_task(tmp_path)

    async def main() -> None:
        async with LocalNetwork(_cfg(task, config), 3, tmp_path) as net:
            for i in range(3):
                net.start(i, [(i + 1) % 3])
            await _trained(net, 5, "3 peers to train 5 steps and merge")

    asyncio.run(main())
    for i in range(3):
        records = read_jsonl(tmp_path / f"peer{i}" / "metrics.jsonl")
        last = records[-1]
        assert {"test_loss", "test_r2", "local_test_loss", "local_test_r2"} <= set(last), last
        assert last["local_test_num_examples"] == 12 and last["final"] is True
        assert last["test_loss"] < records[0]["test_loss"]


@pytest.mark.parametrize(
    "data, expect",
    [
        ("missing.csv", r"local_data\('.*missing\.csv'\) failed: FileNotFoundError.*does not exist"),
        ("bad.csv", r"local_data\('.*bad\.csv'\) failed: ValueError"),
        ("client:7", r"the split has 3 clients"),
    ],
)
def test_a_bad_data_path_is_one_clear_line(tmp_path, data, expect, monkeypatch, capsys):
    """`shoal peer`'s entry point in this process (shoal.cli.main), as the command runs it."""
    from shoal.cli import main

    task, config, _ = _write_task(tmp_path)
    (tmp_path / "bad.csv").write_text("not,a,number\n")
    arg = data if data.startswith("client:") else str(tmp_path / data)
    argv = ["shoal", "peer", "--insecure", "--listen", "127.0.0.1:1", "--task", task, "-c", str(config), "--data", arg]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert exit_.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert re.search(expect, lines[0]) and (data.startswith("client:") or "my_task.py:task" in lines[0]), lines[0]


@pytest.mark.timeout(180)
def test_a_peer_with_another_model_is_refused_by_spec_hash_and_nothing_crashes(tmp_path, caplog):
    """Two peers of the same task file with another width (tests/p2p/network.py: in one event
    loop), each on its own CSV file: each refuses the other's model naming both spec hashes, the
    sender is told the same in the 400 answer, nothing is merged and both keep training."""
    task, config, files = _write_task(tmp_path, 2)
    cfgs = [_cfg(task, config, f"task.args.hidden={hidden}") for hidden in (16, 8)]

    async def main() -> list[dict]:
        async with LocalNetwork(cfgs[0], 2, tmp_path, [str(f) for f in files]) as net:
            for i in range(2):
                net.start(i, [1 - i], cfgs[i])

            def refused_both_ways():
                st = net.statuses(range(2))
                return st if all(s["rejected"] >= 1 and s["steps"] >= 3 for s in st.values()) else None

            statuses = await net.wait_for(refused_both_ways, 120, "each peer to refuse the other's model")
            assert all(p.errors == 0 for p in net.peers.values())
            return [statuses[0], statuses[1]]

    with caplog.at_level(logging.INFO, logger="shoal.p2p"):
        statuses = asyncio.run(main())
    hashes = [s["spec_hash"] for s in statuses]
    assert hashes[0] != hashes[1]
    lines = caplog.text.splitlines()
    for i in range(2):
        assert statuses[i]["merges"] == 0  # nothing of the other model was mixed in
        # the receiver names both hashes; the sender is told the same in the 400 answer
        sent = f"the model sent has spec hash {hashes[1 - i]!r}, this peer's model {hashes[i]!r}"
        ours = f"the model sent has spec hash {hashes[i]!r}, this peer's model {hashes[1 - i]!r}"
        assert any("refused a model: " + sent in ln for ln in lines), caplog.text[-2000:]
        assert any("refused our model" in ln and ours in ln for ln in lines), caplog.text[-2000:]
        records = read_jsonl(tmp_path / f"peer{i}" / "metrics.jsonl")
        assert records[-1]["local_test_r2"] > records[0]["local_test_r2"]  # it kept training on its own
