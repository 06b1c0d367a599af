"""Top-k error feedback in the simulator's engines: refused, late, failed-round and never-sent
uploads fold back into the client's residual (issue 14, item 2).

A ledger records, for every client, each delta its training produced (before the wire) and each
delta the server applied (accumulated in a round that then closed without failing). At the end,
produced = applied + residual + in flight, client by client.
"""

from collections import defaultdict

import pytest
import torch

from shoal.config import load_config
from shoal.simulations.async_engine import AsyncEngine
from shoal.simulations.inprocess import InProcessSimulation
from shoal.simulations.sync_engine import VirtualSyncEngine


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Ledger:
    """Wraps the run's own objects (training, the strategy, the round's close) to record flows."""

    def __init__(self, sim):
        self.produced = defaultdict(lambda: torch.zeros(sim.spec.numel, dtype=torch.float64))
        self.applied = defaultdict(lambda: torch.zeros(sim.spec.numel, dtype=torch.float64))
        self.held: list = []
        self.sim = sim
        train = sim.train_clients

        def tracked_train(tasks, global_params):
            for task, update in train(tasks, global_params):
                self.produced[task.client_id] += update.delta.double()
                yield task, update

        sim.train_clients = tracked_train

    def watch_rounds(self, rounds) -> "Ledger":
        """Sync rounds: an accumulated update is applied when its round closes without failing."""
        accumulate, finish = rounds.strategy.accumulate, rounds.finish_round

        def tracked_accumulate(update, weight=1.0):
            accumulate(update, weight)
            self.held.append((update.sender, update.delta.double().clone()))

        def tracked_finish():
            held, self.held = self.held, []
            s = finish()  # raises when nothing arrived: nothing is applied
            if not s.failed:
                for c, d in held:
                    self.applied[c] += d
            return s

        rounds.strategy.accumulate, rounds.finish_round = tracked_accumulate, tracked_finish
        return self

    def watch_fedasync(self, algorithm) -> "Ledger":
        """FedAsync applies each update it is given at once."""
        apply = algorithm.apply

        def tracked_apply(x, update, staleness, base=None):
            self.applied[update.sender] += update.delta.double()
            return apply(x, update, staleness, base)

        algorithm.apply = tracked_apply
        return self

    def check(self) -> None:
        tk = self.sim.wire.compressor.topk
        flying = defaultdict(lambda: torch.zeros(self.sim.spec.numel, dtype=torch.float64))
        for (c, _), (idx, vals) in tk.in_flight.items():
            flying[c].index_add_(0, idx.long(), vals.double())
        assert self.produced
        for c, made in self.produced.items():
            torch.testing.assert_close(
                self.applied[c] + tk.residuals[c].double() + flying[c], made, atol=1e-5, rtol=1e-5
            )


BASE = [
    "simulation.num_clients=16",
    "simulation.clients_per_round=4",
    "simulation.rounds=8",
    'compression.encoding="topk"',
    "compression.topk_fraction=0.05",
    "output.plots=false",
    "heterogeneity.speed_sigma=1.0",
    "heterogeneity.network_delay_s=0.5",
]


def test_inprocess_accepted_uploads_commit():
    sim = InProcessSimulation.from_config(load_config(None, BASE[:6]))
    ledger = Ledger(sim).watch_rounds(sim.rounds)
    for _ in range(4):
        sim.run_round()
    ledger.check()
    assert not sim.wire.compressor.topk.in_flight


def test_inprocess_refused_uploads_fold_back():
    """NaN attackers' payloads are refused by validation; theirs fold back, the others' commit."""
    sim = InProcessSimulation.from_config(load_config(None, [*BASE[:6], 'attack.kind="nan"', "attack.fraction=0.25"]))
    ledger = Ledger(sim).watch_rounds(sim.rounds)
    refused = 0
    for _ in range(4):
        refused += sim.run_round().rejected.get("non_finite", 0)
    assert refused > 0
    tk = sim.wire.compressor.topk
    attackers = {c for c in ledger.produced if bool(torch.isnan(tk.residuals[c]).any())}
    honest = set(ledger.produced) - attackers
    assert attackers and honest
    for c in attackers:  # nothing of a refused payload was applied, and none of it was zeroed as "sent"
        assert not bool(ledger.applied[c].any())
        assert bool(torch.isnan(tk.residuals[c]).all())
    ledger.produced = {c: ledger.produced[c] for c in honest}
    ledger.check()


def test_late_uploads_dropped_fold_back():
    e = VirtualSyncEngine(
        load_config(
            None, [*BASE, "heterogeneity.enabled=true", "asynchronous.deadline_s=3.0", 'asynchronous.late="drop"']
        )
    )
    ledger = Ledger(e.sim).watch_rounds(e.rounds)
    list(e.run())
    assert e.rejected.get("late", 0) > 0
    ledger.check()


def test_uploads_in_failed_rounds_fold_back():
    e = VirtualSyncEngine(
        load_config(
            None,
            [
                *BASE,
                "heterogeneity.enabled=true",
                "asynchronous.deadline_s=3.0",
                "asynchronous.min_fraction=0.9",
                "simulation.rounds=6",
            ],
        )
    )
    ledger = Ledger(e.sim).watch_rounds(e.rounds)
    list(e.run())
    assert e.failed_rounds > 0 and e.rounds.version > 0
    ledger.check()


def test_never_sent_uploads_fold_back():
    """Clients going offline mid-task never deliver (async engine): what they encoded folds back."""
    e = AsyncEngine(
        load_config(
            None,
            [
                *BASE,
                'simulation.mode="async"',
                'asynchronous.algorithm="fedasync"',
                "heterogeneity.mean_on_s=6.0",
                "heterogeneity.mean_off_s=6.0",
                "simulation.rounds=10",
            ],
        )
    )
    ledger = Ledger(e.sim).watch_fedasync(e.rounds.algorithm)
    list(e.run())
    assert e.totals()["dropouts"] > 0
    ledger.check()
