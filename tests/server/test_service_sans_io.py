"""ServerService is a state machine without I/O: time comes in as ``now``, effects leave as
events (server/service.py); server/store.py makes them files. Sync and async rounds are
driven through the one Rounds protocol."""

from __future__ import annotations

import json

import torch

from shoal.server.checkpoint import latest_checkpoint
from shoal.server.events import Checkpoint, Record, Restored
from shoal.server.service import ServerService
from shoal.server.store import ServerStore, open_service
from shoal.update import Update
from shoal.wire import encode_update

from .live import small_config


def _upload(svc: ServerService, node: str, version: int, value: float, round_: int | None = None) -> bytes:
    extra = {"round": round_} if round_ is not None else None
    return encode_update(Update(torch.full((svc.spec.numel,), value), 7, version, node), svc.spec, extra)


def _sync_round(svc: ServerService, now: float) -> None:
    """Every selected node sends one update; the clock closes the round."""
    assert svc.tick(now)  # opens a round over the connected nodes
    for node in sorted(svc.rounds.status_fields()["selected"]):
        work = svc.poll(node, now)
        svc.submit(node, _upload(svc, node, work["version"], 0.01, work["round"]), now)
    assert svc.tick(now + 1)  # closes it into a new version


def test_a_sync_round_touches_no_file_and_emits_checkpoint_then_record(tmp_path):
    cfg = small_config(tmp_path, clients_per_round=2, min_nodes=2, rounds=3)
    usage = iter([(1.0, 50.0), (1.75, 60.0)])  # the process's CPU seconds and resident MB, as read
    svc = ServerService.from_config(cfg, started_at=100.0, process_usage=lambda: next(usage))
    for node in ("a", "b", "c"):
        svc.seen(node, 100.0)
    _sync_round(svc, 101.0)
    assert svc.version == 1
    assert not any(tmp_path.iterdir()), "the state machine wrote files"
    kinds = [type(e).__name__ for e in svc.events]
    assert kinds == ["Checkpoint", "Record"]  # a crash between them loses a line, never a version
    record = svc.events[1]
    assert isinstance(record, Record)
    assert record.fields["version"] == 1 and record.fields["num_results"] == 2
    assert record.fields["elapsed_s"] == 2.0  # now - started_at: time came in, none was read
    # the server's cost of each version: seconds since the last one, CPU seconds in them, memory
    assert (record.fields["server_round_s"], record.fields["server_rss_mb"]) == (2.0, 50.0)
    _sync_round(svc, 103.0)
    second = svc.events[-1].fields  # type: ignore[attr-defined]
    assert (second["server_round_s"], second["server_cpu_s"], second["server_rss_mb"]) == (2.0, 0.75, 60.0)


def test_the_store_makes_events_durable_and_a_restart_resumes_from_them(tmp_path):
    cfg = small_config(tmp_path, clients_per_round=2, min_nodes=2, rounds=3)
    svc = open_service(cfg, started_at=0.0)
    for node in ("a", "b"):
        svc.seen(node, 0.0)
    _sync_round(svc, 1.0)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines] == [1]
    assert latest_checkpoint(tmp_path / "ck") is not None
    restored = ServerStore(cfg).restore(resume=True)
    assert restored.checkpoint is not None
    again = ServerService.from_config(cfg, restored=restored)
    assert again.version == 1 and again.resumed_from == restored.checkpoint[0]
    torch.testing.assert_close(again.rounds.global_params, svc.rounds.global_params)
    assert ServerService.from_config(cfg, restored=Restored()).version == 0  # --fresh: nothing handed in


def test_async_versions_advance_in_submit_through_the_same_protocol(tmp_path):
    sections = {"asynchronous": {"algorithm": "fedbuff", "buffer_size": 2}}
    svc = ServerService.from_config(small_config(tmp_path, sections, mode="async", rounds=4, min_nodes=2))
    assert svc.poll("a", 0.0) is None  # below min_nodes: no work handed out yet
    works = {n: svc.poll(n, 0.0) for n in ("a", "b")}
    assert works["b"]["status"] == "work" and "deadline_s" not in works["b"]
    assert svc.tick(0.0) is False  # async versions are not made on the clock
    for n in ("a", "b"):
        w = svc.poll(n, 0.0)
        svc.submit(n, _upload(svc, n, w["version"], 0.02), 0.5)
    assert svc.version == 1
    (ckpt, record) = svc.events
    assert isinstance(ckpt, Checkpoint) and ckpt.version == 1
    assert isinstance(record, Record) and record.fields["updates_accepted"] == 2
    assert svc.status(0.5)["outstanding"] == 0 and svc.status(0.5)["round"] == 1
    assert not any(tmp_path.iterdir())
