"""The federation's trust boundaries: runs name only registered tasks, researchers see and act on
only their own runs (and under DP only what the accountant covers), and no run lowers a floor.

Protocol-level where it can be (Federation, NodeConfig.check, the release policy), one in-process
aiohttp federation for the routes, and the task check's worker process once."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import sys
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from shoal.aggregation.secagg.encoding import FixedPoint
from shoal.cli import app as cli
from shoal.client.node_config import AllowedTask, Limits, NodeConfig, load_node_config
from shoal.config import config_from_dict
from shoal.errors import ConfigError
from shoal.server.federation.release import researcher_line, researcher_view
from shoal.server.federation.runs import Federation, RunError
from shoal.server.federation.runs_db import RunsDB
from shoal.server.task_check import TaskChecker
from shoal.server.task_registry import TaskRegistry, add_task, task_sha256
from shoal.strict_json import loads_strict
from shoal.tensor_file import save_file
from tests.server.federation_live import served_federation
from tests.server.task_files import write_task

BUILTIN_RUN = {"server": {"rounds": 2, "min_nodes": 3, "poll_s": 1.0, "eval": False}, "train": {"batch_size": 8}}
SECURE_RUN = {**BUILTIN_RUN, "secure_aggregation": {"enabled": True}}

# What the process opened and imported while a hostile submission was handled (sys.addaudithook
# cannot be removed: it records only while a test has it on).
_SEEN: list[tuple[str, str]] | None = None


def _audit(event: str, args: tuple) -> None:
    if _SEEN is not None and event in ("open", "import") and args:
        _SEEN.append((event, str(args[0])))


sys.addaudithook(_audit)


def _federation(tmp: Path, **federation) -> Federation:
    cfg = config_from_dict({"federation": {"enabled": True, "dir": str(tmp / "fed"), **federation}}).validate()
    return Federation(cfg, RunsDB(tmp / "fed" / "runs.sqlite"))


def test_a_run_names_only_a_registered_task_and_nothing_it_names_is_opened_or_imported(tmp_path, caplog):
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\ntask = None\n")
    fed = _federation(tmp_path)
    hostile = ["subprocess:getoutput", "os:system", "/dev/zero:x", f"{evil}:task", "evil:task", "../../etc/passwd:x"]
    global _SEEN
    for ref in hostile:
        _SEEN = []
        with caplog.at_level(logging.WARNING, logger="shoal.server.federation.runs"), pytest.raises(RunError) as e:
            fed.prepare(ref, {}, "mallory")
        seen, _SEEN = _SEEN, None
        assert e.value.status == 400 and e.value.code == "task_not_registered", e.value
        assert "\n" not in str(e.value) and "shoal server tasks add" in str(e.value)
        assert not [s for s in seen if "zero" in s[1] or "evil" in s[1] or "subprocess" in s[1]], seen
        assert any("mallory" in r.getMessage() and "task_not_registered" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "ran").exists() and "evil" not in sys.modules
    fed.close()


def test_the_registry_file_pins_a_task_and_a_changed_source_is_refused(tmp_path):
    path = write_task(tmp_path / "tasks")
    runner = CliRunner()
    args = ["--set", f'federation.dir="{tmp_path / "fed"}"']
    res = runner.invoke(cli, ["server", "tasks", "add", "regression", f"{path}:Regression", *args])
    assert res.exit_code == 0, res.output
    assert task_sha256(f"{path}:Regression") in res.output
    res = runner.invoke(cli, ["server", "tasks", "list", *args])
    assert "regression\tregistry" in res.output and "builtin\tbuiltin" in res.output, res.output
    fed = _federation(tmp_path)
    sub = fed.prepare("regression", {"task": {"args": {"hidden": 4}}}, "alice")
    assert sub.entry.ref == f"{path.resolve()}:Regression" and sub.cfg.task.app == sub.entry.ref
    fed.tasks.verify(sub.entry)
    path.write_text(path.read_text() + "\n# changed\n")  # the source changed since it was registered
    with pytest.raises(RunError, match="its source changed since it was registered"):
        fed.tasks.verify(sub.entry)
    with pytest.raises(ConfigError, match="not a regular file"):
        add_task(tmp_path / "fed" / "tasks.json", "zero", "/dev/zero:x")
    with pytest.raises(ConfigError, match="task name"):
        add_task(tmp_path / "fed" / "tasks.json", "r\u0435gression", f"{path}:Regression")  # a Cyrillic e
    res = runner.invoke(cli, ["server", "tasks", "remove", "regression", *args])
    assert res.exit_code == 0, res.output
    with pytest.raises(RunError, match="not registered"):
        fed.prepare("regression", {}, "alice")
    fed.close()


@pytest.mark.timeout(120)
def test_a_user_task_is_checked_in_a_worker_with_memory_and_time_limits(tmp_path):
    """The one process-level check: the worker imports the registered task with the run's args
    (never the server), answers the model's size, and refuses a model over its memory and a task
    over its time; the server's own memory does not move."""
    ref = f"{write_task(tmp_path / 'tasks')}:Regression"
    slow = tmp_path / "slow.py"
    slow.write_text("import time\n\ndef task():\n    time.sleep(30)\n")
    base = config_from_dict({"task": {"app": ref}}).validate().to_dict()
    checker = TaskChecker(memory_mb=1024, timeout_s=60)
    try:
        assert checker.check(base) == (4 * 8 + 8 + 8 + 1, None)
        huge = {**base, "task": {"app": ref, "args": {"hidden": 10**9}}}  # 16 GB of weights
        size, why = checker.check(huge)
        assert size is None and why is not None and "task_check_mb = 1024" in why, why
        assert checker.check(base)[1] is None  # the same worker answers the next check
        assert "regtask" not in " ".join(sys.modules)  # never imported here
        checker.timeout_s = 3.0
        size, why = checker.check({**base, "task": {"app": f"{slow}:task", "args": {}}})
        assert size is None and why is not None and "task_check_s = 3" in why, why
    finally:
        checker.close()


def test_floors_a_run_cannot_lower_at_submission_and_at_the_node(tmp_path):
    fed = _federation(tmp_path, min_secure_group=4, max_epochs=3, privacy_modes=["none", "central"])
    refused = {
        "secure_aggregation.min_inputs = 1 must be >= 3": {**SECURE_RUN, "secure_aggregation": {"min_inputs": 1}},
        "secure_aggregation.min_inputs = 3 is below the federation's floor of 4": {
            **SECURE_RUN,
            "server": {**SECURE_RUN["server"], "clients_per_round": 4},
        },
        "server.clients_per_round = 3 with secure aggregation": {
            **SECURE_RUN,
            "server": {**SECURE_RUN["server"], "clients_per_round": 3},
            "secure_aggregation": {"enabled": True, "min_inputs": 4},
        },
        "train.epochs = 5 is over the federation's limit of 3": {"train": {"epochs": 5}},
        "privacy.mode = 'local' is not one the federation's operator allows": {"privacy": {"mode": "local"}},
        "train.lr = nan must be a finite number": {"train": {"lr": math.nan}},
        "data.dir names a file on the server": {"data": {"dir": "/etc"}},
    }
    for reason, run in refused.items():
        with pytest.raises(RunError) as e:
            fed.prepare("builtin", run, "alice")
        assert e.value.status == 400 and reason in str(e.value), (reason, e.value)
    ok = {
        "server": {**SECURE_RUN["server"], "clients_per_round": 4},
        "secure_aggregation": {"enabled": True, "min_inputs": 4},
    }
    assert fed.prepare("builtin", ok, "alice").cfg.secure_aggregation.min_inputs == 4
    fed.close()

    node = NodeConfig(
        server="https://x",
        token_file=None,
        name="n0",
        limits=Limits(min_secure_group=5, max_epochs=2, min_noise_multiplier=1.0),
        tasks={"builtin": AllowedTask("builtin", "builtin", tmp_path)},
    )

    def offer(config: dict) -> dict:
        return {"run": "run-1", "task": "builtin", "task_sha256": "builtin", "config": config}

    secure4 = {**SECURE_RUN, "server": {**SECURE_RUN["server"], "clients_per_round": 4}}
    assert "below node n0's floor of 5" in node.check(offer(secure4))
    assert "min_inputs = 1 must be >= 3" in node.check(offer({**SECURE_RUN, "secure_aggregation": {"min_inputs": 1}}))
    dp = {"privacy": {"mode": "central", "noise_multiplier": 0.5}}
    assert "privacy.noise_multiplier = 0.5 is below node n0's floor of 1" in node.check(offer(dp))
    assert node.check(offer({"train": {"epochs": 2}})) is None


NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=8),
    st.none(),
)
KEYS = {
    "train": ["epochs", "lr", "batch_size", "momentum", "prox_mu"],
    "server": ["rounds", "clients_per_round", "min_nodes", "deadline_s", "max_examples", "checkpoint_dir"],
    "privacy": ["mode", "noise_multiplier", "clip_norm", "target_epsilon", "delta"],
    "secure_aggregation": ["enabled", "min_inputs", "clip", "bits", "threshold"],
    "data": ["dir", "dataset"],
    "federation": ["tasks"],
}
RUN_CONFIGS = st.dictionaries(
    st.sampled_from(sorted(KEYS)),
    st.none(),
    max_size=4,
).flatmap(
    lambda tables: st.fixed_dictionaries(
        {
            t: st.dictionaries(st.sampled_from(KEYS[t]), NUMBERS | st.sampled_from(["central", "local"]), max_size=4)
            for t in tables
        }
    )
)


_FUZZED: dict[str, Federation] = {}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run=RUN_CONFIGS)
def test_hostile_run_configs_are_refused_in_one_line_or_kept_within_every_floor(tmp_path_factory, run):
    if "fed" not in _FUZZED:
        _FUZZED["fed"] = _federation(tmp_path_factory.mktemp("fuzz"), min_secure_group=4, max_epochs=3)
    fed = _FUZZED["fed"]
    node = NodeConfig(server="https://x", token_file=None, name="n0", tasks={})
    assert node.check({"run": "run-1", "task": "builtin", "task_sha256": "builtin", "config": run}) is not None
    try:
        sub = fed.prepare("builtin", run, "mallory")
    except RunError as e:
        assert e.status in (400, 413) and "\n" not in str(e)
        return
    cfg = sub.cfg
    for section in cfg.to_dict().values():
        for v in section.values():
            assert not (isinstance(v, float) and math.isnan(v))
    assert cfg.train.epochs <= 3 and cfg.server.checkpoint_dir.startswith(str(fed.dir))
    assert cfg.data.dir == "" and (not cfg.secure_aggregation.enabled or cfg.secure_aggregation.min_inputs >= 4)


def test_the_release_policy_shows_a_researcher_of_a_dp_run_no_selection_and_no_node():
    status = {
        "run": "run-1",
        "task": "builtin",
        "status": "running",
        "submitted_by": "alice",
        "config": {"privacy": {"mode": "central"}},
        "nodes": {"n0": {"answer": "joined"}, "n3": {"answer": "refused", "reason": "train.epochs over n3's limit"}},
        "service": {
            "mode": "sync",
            "round": 4,
            "version": 3,
            "selected": ["n0", "n1"],
            "reported": ["n0"],
            "connected_nodes": ["n0", "n1", "n2"],
            "updates_accepted": 7,
            "last_metrics": {"round": 3, "version": 3, "num_results": 2, "train_loss": 0.3, "epsilon": 1.5},
            "privacy": {"epsilon": 1.5, "delta": 1e-5, "node_epsilon": {"n0": 2.0}, "registered_nodes": 3},
        },
    }
    dp = config_from_dict({"privacy": {"mode": "central"}})
    view = researcher_view(status, dp)
    text = json.dumps(view)
    for secret in (
        "selected",
        "reported",
        "connected_nodes",
        "updates_accepted",
        "num_results",
        "node_epsilon",
        '"n0"',
    ):
        assert secret not in text, (secret, view)
    assert view["service"]["privacy"]["epsilon"] == 1.5 and view["service"]["last_metrics"]["epsilon"] == 1.5
    assert view["refusals"] == ["train.epochs over n3's limit"]
    clear = config_from_dict({"privacy": {"mode": "central", "release": "clear"}})
    assert "num_results" not in researcher_line(status["service"]["last_metrics"], clear)  # clear is the admin's
    assert researcher_view(status, config_from_dict({})) is status  # no DP: everything of one's own run
    assert "train_loss" not in researcher_view(status, None)["service"]["last_metrics"]  # unknown: nothing


@pytest.mark.timeout(60)
def test_researchers_own_their_runs_and_a_refusing_node_gets_no_work(tmp_path):
    alice, bob = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    nodes = ["n0", "n1", "n2"]

    async def main():
        async with served_federation(tmp_path, nodes, BUILTIN_RUN, researchers={"alice": alice, "bob": bob}) as live:

            def as_(token: str) -> aiohttp.ClientSession:
                return aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"})

            async with (
                as_(alice) as s,
                s.post(live.url + "/v1/runs", json={"task": "builtin", "config": BUILTIN_RUN}) as r,
            ):
                assert r.status == 201, await r.text()
                run = (await r.json())["run"]
            async with as_(alice) as s, s.post(live.url + "/v1/runs", json={"task": "os:system", "config": {}}) as r:
                body = await r.json()
                assert r.status == 400 and body["error"] == "task_not_registered", body
            async with as_(bob) as s:
                for method, path in (
                    ("GET", f"/v1/runs/{run}"),
                    ("GET", f"/v1/runs/{run}/metrics"),
                    ("POST", f"/v1/runs/{run}/stop"),
                    ("GET", f"/v1/runs/{run}/files/model.safetensors"),
                ):
                    async with s.request(method, live.url + path) as r:
                        assert r.status == 403 and (await r.json())["error"] == "not_your_run", (path, r.status)
                async with s.get(live.url + "/v1/runs") as r:
                    assert (await r.json())["runs"] == []
            async with as_(alice) as s, s.get(live.url + "/v1/runs") as r:
                assert [x["run"] for x in (await r.json())["runs"]] == [run]
            async with as_(live.tokens["admin"]) as s, s.get(live.url + "/v1/runs") as r:
                assert len((await r.json())["runs"]) == 2  # the admin sees every run
            assert run not in live.fed.user_stopped and live.fed.db.get(run).status in ("queued", "running")

            # a node that refused the run for good gets none of its work; JSON with a repeated key is refused
            url = live.url + "/runs/run-1"
            async with as_(live.tokens["n0"]) as s:
                dup = b'{"answer": "joined", "answer": "refused", "reason": "x"}'
                async with s.post(url + "/v1/answer", data=dup, headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 400 and "given twice" in (await r.json())["detail"]
                async with s.post(url + "/v1/answer", json={"answer": "refused", "reason": "not mine"}) as r:
                    assert r.status == 200
                async with s.get(url + "/v1/task") as r:
                    assert r.status == 403 and (await r.json())["error"] == "refused_run"
            async with as_(live.tokens["n1"]) as s, s.get(url + "/v1/task") as r:
                assert r.status == 200

            # the page's login form with a body that is not UTF-8: 400, not 500
            async with aiohttp.ClientSession() as s:
                headers = {"Origin": live.url, "Content-Type": "application/x-www-form-urlencoded"}
                async with s.post(live.url + "/login", data=b"token=\xff\xfe%ff", headers=headers) as r:
                    assert r.status == 400, await r.text()

    asyncio.run(main())


def test_smaller_refusals_nan_encoding_duplicate_keys_names_and_canonical_files(tmp_path):
    codec = FixedPoint(clip=1.0, bits=16, max_summands=8)
    with pytest.raises(ValueError, match="NaN"):
        codec.encode(np.array([0.5, math.nan]), np.random.default_rng(0))
    with pytest.raises(ValueError, match="given twice"):
        loads_strict(b'{"a": 1, "a": 2}')
    with pytest.raises(ValueError, match="not UTF-8"):
        loads_strict(b'{"a": "\xff"}')
    tensors = {"b": torch.arange(3.0), "a": torch.ones(2, 2)}
    meta = {"version": "3", "spec_hash": "abc", "z": "1", "m": "2"}
    save_file(tensors, tmp_path / "one.safetensors", meta)
    save_file(dict(reversed(tensors.items())), tmp_path / "two.safetensors", dict(reversed(meta.items())))
    assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "two.safetensors").read_bytes()
    toml = tmp_path / "node.toml"
    toml.write_text('[node]\nserver = "https://x"\ntoken_file = "t"\nname = "n\u04350"\n')  # a Cyrillic e
    with pytest.raises(ConfigError, match="node name"):
        load_node_config(toml)
    registry = TaskRegistry(tmp_path / "none.json", [])
    assert sorted(registry.entries()) == ["builtin", "shoal.tasks:BuiltinTask", "shoal.tasks:SyntheticPopulationTask"]
