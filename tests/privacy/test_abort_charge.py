"""What secure rounds' aborts cost under Poisson sampling (shoal.accounting_aborts): the union bound's
failure probability phi a round (kept to compare), and, an abort released as an empty round, the
mixture's branches (no dropouts: exact; injected dropouts or `shoal server`: a node deciding the abort
with a bounded probability, at K_max C; fixed-size: nothing), in the simulator and in the server."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import binom

from shoal.accounting import epsilon
from shoal.accounting_aborts import abort_branches, abort_delta, bounded_branches, simulated_branches
from shoal.assembly import build
from shoal.config import load_config
from shoal.errors import ConfigError

REVIEWED = [  # N = 10, K = 5, t = 3, z = 1, 15 rounds: the configuration a review priced at ~6.0 with aborts
    "simulation.num_clients=10",
    "simulation.clients_per_round=5",
    "simulation.rounds=15",
    "secure_aggregation.enabled=true",
    'privacy.mode="distributed"',
    "privacy.noise_multiplier=1.0",
    "secure_aggregation.clip=6",  # C + 8 share stds
    "output.plots=false",
]


def test_phi_is_the_chance_a_sampled_client_meets_a_boundary():
    # m ~ Binomial(9, 1/2) others: m = t - 1 = 2 (abort without x, a sum of 3 with it) or m = 0
    assert abort_delta(10, 0.5, 3, 10) == pytest.approx(0.5 * (36 + 1) / 512)
    # the cap: with K_max = 6 of N = 10, 6 or more others push a round with x past it
    assert abort_delta(10, 0.5, 3, 6) == pytest.approx(0.5 * (binom.pmf(2, 9, 0.5) + 0.5**9 + binom.sf(5, 9, 0.5)))
    assert abort_delta(1000, 0.1, 50, 177) < 2e-10  # a large population makes a round of t - 1 improbable
    # released as empty rounds: m <= 1 costs nothing, m = 2 a Gaussian of sensitivity 3C, else C
    branches = abort_branches(10, 0.5, 3, 10)
    assert [s for s, _ in branches] == [0.0, 1.0, 3.0]
    assert [p for _, p in branches] == pytest.approx([10 / 512, 466 / 512, 36 / 512])
    cfg = load_config(None, REVIEWED)
    assert simulated_branches(cfg, 10, 0.5, 3, 10) == branches
    dropped = load_config(None, [*REVIEWED, "secure_aggregation.dropout_masked=0.1"])
    assert simulated_branches(dropped, 10, 0.5, 3, 10) == bounded_branches(1.0, 10)  # not bounded: the worst
    fixed = load_config(None, [*REVIEWED, 'privacy.sampling="fixed"'])
    assert simulated_branches(fixed, 10, 0.5, 3, 5) is None  # the sample's size does not depend on the data


def test_the_reviewed_configuration_runs_with_its_aborts_priced_as_a_mixture():
    """Refused under the union bound (delta 0.036 a round, past 1/N in 3 rounds), it now runs: its aborts
    are released as empty rounds and every round is priced as the mixture, above the plain Gaussian."""
    parts = build(load_config(None, REVIEWED), None, "simulation")
    assert parts.secure is not None and parts.privacy is not None
    acc = parts.privacy.accountant
    assert parts.secure.abort_branches == acc.abort_branches == abort_branches(10, 0.5, 3, parts.secure.max_summands)
    assert epsilon(0.5, 1.0, 15, 1e-5) < acc.epsilon_after(15) < 100
    parts = build(load_config(None, [*REVIEWED, 'privacy.sampling="fixed"']), None, "simulation")
    assert parts.secure is not None and parts.secure.abort_branches is None


def test_an_aborted_secure_round_is_released_as_an_empty_round_and_charged_as_a_mixture(tmp_path):
    """shoal server, distributed discrete Gaussian under secure aggregation, Poisson q = 4/20: a round
    whose selected nodes never answer aborts (too few survivors) and is finished as a round that
    selected nobody: a new version of noise alone, a metrics record with the same fields as an empty
    round's (no "aborted", and no timing: the empty one closes at once), so no release tells an abort
    apart; every round is charged as the mixture of bounded_branches (a node deciding the abort with
    probability privacy.abort_bound, at K_max C)."""
    import json

    from shoal.accounting_aborts import bounded_branches, flip_probability
    from shoal.accounting_mixture import as_json
    from shoal.privacy_plan import SERVED_TIMING
    from shoal.server.federation.release import researcher_line
    from shoal.server.store import open_service

    from ..server.live import small_config

    sections = {
        "privacy": {
            "mode": "distributed",
            "mechanism": "discrete_gaussian",
            "noise_multiplier": 1.0,
            "clip_norm": 1.0,
            "abort_bound": 0.3,
        },
        "secure_aggregation": {"enabled": True, "stage_s": 1.0},
    }
    cfg = small_config(tmp_path, sections, clients_per_round=4, rounds=60, deadline_s=1.0)
    svc = open_service(cfg, registered=20)
    p = svc.privacy
    assert p.accountant.abort_branches == bounded_branches(0.3, p.cohort)
    assert flip_probability(20, 0.2, p.noise_shares, p.cohort) < 0.3  # what the declaration must cover
    nodes = [f"n{i}" for i in range(5)]
    now, kinds = 0.0, {}
    for _ in range(60):  # until both an empty and an aborted round ran (P[none empty] < 1e-7)
        for n in nodes:
            svc.poll(n, now)
        before, version = svc.rounds.global_params.clone(), svc.version
        assert svc.tick(now)  # opens a round
        kind = "aborted" if svc.secure_round is not None else "empty"
        while svc.rounds.open:  # nobody answers: the stages close at their deadlines
            now += 10.0
            svc.tick(now)
        assert svc.version == version + 1 and not torch.equal(svc.rounds.global_params, before)
        kinds.setdefault(kind, svc.version)
        if len(kinds) == 2:
            break
        now += 10.0
    assert set(kinds) == {"aborted", "empty"} and svc.secure_last["aborted"]  # the admin's status says it
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    by_version = {r["version"]: r for r in lines}
    aborted, empty = by_version[kinds["aborted"]], by_version[kinds["empty"]]
    assert "aborted" not in aborted and "failed" not in aborted
    assert set(aborted) == set(empty)
    # nor does its timing: an empty round closed at once, an aborted one at its stages' deadlines, and
    # no released record (metrics.jsonl, the researcher's view of a federation run) carries a clock
    assert not any(SERVED_TIMING & set(r) for r in lines)
    seen = [researcher_line(r, cfg) for r in (aborted, empty)]
    assert set(seen[0]) == set(seen[1]) and not SERVED_TIMING & set(seen[0])
    differ = {k for k in seen[0] if seen[0][k] != seen[1][k] and not k.startswith("test_")}  # the model's own
    assert differ <= {"round", "version", "epsilon", "rounds_charged", "epsilon_server", "server_accountant"}
    assert svc.clock.latest >= now - 10.0  # the operator's clock (log, checkpoint) still runs
    assert open_service(cfg, registered=20).clock.elapsed_before == svc.clock.latest  # and resumes from it
    entry = p.accountant.ledger[-1]
    assert entry["abort_branches"] == as_json(bounded_branches(0.3, p.cohort))
    assert aborted["rounds_charged"] == kinds["aborted"] and p.rounds_charged == svc.version  # every round charged


def test_an_abort_bound_below_the_sampling_alone_and_below_the_federation_floor_is_refused(tmp_path):
    from shoal.floors import below_floor
    from shoal.server.store import open_service

    from ..server.live import small_config

    sections = {
        "privacy": {"mode": "distributed", "noise_multiplier": 1.0, "clip_norm": 1.0, "abort_bound": 0.01},
        "secure_aggregation": {"enabled": True},
    }
    cfg = small_config(tmp_path, sections, clients_per_round=4)
    with pytest.raises(ConfigError, match="privacy.abort_bound = 0.01 is below"):
        open_service(cfg, registered=6)  # q = 2/3: x deciding the abort without dropouts is likely
    fed = small_config(tmp_path, {}).federation
    assert "below the federation's floor of 1" in str(below_floor(fed, cfg, "the federation's"))
    fed.min_abort_bound = 0.01
    assert below_floor(fed, cfg, "the federation's") is None
