"""Smaller fixes an operator meets: elapsed_s goes on after a restart, connection errors without an
SSL context's repr, the node daemon's TLS hint names node.ca_cert, `shoal report` draws a peer's and
a federation's evaluation figures, and the default privacy sweep leaves out local DP for Datasets."""

from __future__ import annotations

import json
import logging

import torch
from torch.utils.data import Dataset

from shoal.client.daemon import node_setting
from shoal.client.http import Retry
from shoal.config import load_config
from shoal.report import load_run, panels
from shoal.server.store import last_elapsed
from shoal.simulations.privacy_sweep import settings, skip_local_dp_for_datasets
from shoal.task import SimulationData


def test_a_resumed_run_counts_elapsed_s_on_from_its_last_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert last_elapsed(path) == 0.0  # no file yet
    lines = [{"round": 1, "elapsed_s": 12.5}, {"version": 1, "evaluation": "federated", "elapsed_s": 13.0}, {}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + "{not json\n")
    assert last_elapsed(path) == 13.0


def test_connection_errors_carry_no_ssl_context_repr_and_the_ca_hint_names_the_node_setting():
    e = Retry(
        "GET /v1/offers: ClientConnectorError: Cannot connect to host h:8443 ssl:<ssl.SSLContext object at 0x7f3a>"
    )
    assert "SSLContext" not in str(e) and "Cannot connect to host h:8443 over TLS" in str(e)
    line = node_setting("... not signed by a CA this node trusts (x): give the federation's ca.pem with --ca-cert (a)")
    assert "as node.ca_cert in the node's config" in line and "--ca-cert" not in line


def test_report_draws_a_peers_local_test_figures_and_a_federations_fed_figures(tmp_path):
    (tmp_path / "fed").mkdir()
    (tmp_path / "peer").mkdir()
    fed = [
        {"round": 1, "version": 1, "train_loss": 1.0},
        {"version": 1, "evaluation": "federated", "fed_accuracy": 0.5},
    ]
    peer = [{"round": r, "local_test_accuracy": 0.5 + r / 10, "local_test_num_examples": 20} for r in (1, 2)]
    (tmp_path / "fed" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fed))
    (tmp_path / "peer" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in peer))
    ps = panels([load_run(tmp_path / "peer"), load_run(tmp_path / "fed")])
    assert ps[0].title == "fed accuracy"  # each run drawn with its own test figures
    assert ps[0].curves == {"peer": [(1, 0.6), (2, 0.7)], "fed": [(1, 0.5)]}


class Items(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.zeros(3), 0


def test_the_default_sweep_leaves_out_local_dp_for_dataset_data_saying_so_once(caplog):
    cfg = load_config(None, [])
    grid = settings(cfg)
    assert any(m == "local" for m, _ in grid)
    data = SimulationData(train=[Items(), Items()])
    with caplog.at_level(logging.WARNING):
        kept = skip_local_dp_for_datasets(grid, cfg, data)
    assert [s for s in grid if s[0] != "local"] == kept
    assert sum("skipping the" in r.message for r in caplog.records) == 1
    tensors = SimulationData(train=[(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))])
    assert skip_local_dp_for_datasets(grid, cfg, tensors) == grid
    cfg.privacy.sweep_modes = ["local"]  # asked for by name: kept (and each setting says why it fails)
    assert skip_local_dp_for_datasets(settings(cfg), cfg, data) == settings(cfg)
