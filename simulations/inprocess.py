"""The in-process engine: many simulated clients in one Python process.

Clients are data (a contiguous slice of one device-resident training tensor, or a torch
Dataset) plus a seed, not model copies: one LocalTrainer trains each selected client in
turn, so 10,000 clients cost the dataset's memory once. Model, loss, metrics and data come
from the task (shoal/task.py); the objects are made by shoal.assembly; the round logic
is shoal.rounds' SyncRounds, the same object the HTTP server drives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch

from shoal import assembly
from shoal.aggregation.secagg import SecAggAborted
from shoal.assembly import SimulationParts
from shoal.client.algorithms import ClientResult
from shoal.client.pipeline import ClientPipeline
from shoal.client.state import State
from shoal.client.training import summarize_means
from shoal.config import Config
from shoal.errors import WireError
from shoal.privacy_plan import plan_of
from shoal.rounds import Assignment, RoundSummary, evaluation_due
from shoal.seeding import derive_seed
from shoal.task import ClientData, Population, SimulationData, Task
from shoal.update import Update

from .attacks import attack_steps
from .client_data import (
    ClientShards,
    PopulationShards,
    client_id,
)
from .hierarchy import HierarchicalRound
from .round_runner import ClientPool, ClientStep, RoundRunner, SummingRunner
from .run_loop import Report, Step
from .secure_rounds import SecureAggregationRounds

log = logging.getLogger(__name__)

__all__ = ["ClientPool", "ClientShards", "InProcessSimulation", "RoundRunner", "SummingRunner", "client_id"]


_FED_EVAL_STREAM = 0xFEDE  # seeds a population's federated-evaluation sample apart from client sampling


class LocalClients:
    """The selected clients train here, through the simulation's client pipeline (client/pipeline.py):
    batched when the model and task allow (client/batched.py), else one by one with the algorithm's
    local step, with the client's state from ``sim.states`` (FedBN's buffers, control variates,
    personal parameters)."""

    def __init__(self, sim: InProcessSimulation):
        self.sim = sim

    def train(self, tasks: list[Assignment], global_params: torch.Tensor) -> Iterator[tuple[Assignment, Update]]:
        sim = self.sim
        indices = [sim.client_index(t.client_id) for t in tasks]
        # a population's cohort is loaded and concatenated at once; held data are sliced in place
        return sim.pipeline.run(
            tasks,
            global_params,
            sim.broadcast(),
            lambda j: sim.shards.data(indices[j]),
            lambda: sim.shards.gather(indices),
        )


class PlainRound:
    """Each client trains, its update passes the client steps (attack, DP noise share, the
    wire round trip) and reaches the aggregator on its own."""

    def __init__(self, sim: InProcessSimulation):
        self.sim = sim

    def updates(self, tasks: list[Assignment], global_params: torch.Tensor) -> Iterator[tuple[Assignment, Update]]:
        for task, update in self.sim.train_clients(tasks, global_params):
            sent = self.sim.apply_client_steps(task, update)
            if sent is not None:
                yield task, sent


class InProcessSimulation:
    """Runs rounds on the parts shoal.assembly built (:class:`~shoal.assembly.SimulationParts`);
    :meth:`from_config` builds them from a Config.

    Composed, not patched: the client pool (``LocalClients``: one by one or batched, here;
    passed as ``clients`` to train elsewhere or to replace some clients), ``client_steps``
    (what happens to each update before it is sent) and the
    round runner (``PlainRound``, secure aggregation's ``SecureAggregationRounds`` or virtual edges'
    ``HierarchicalRound``, as the parts name it, or passed as ``runner``, a function of the simulation).
    Every part is read as built: nothing here or in a runner re-wires one.
    """

    def __init__(
        self,
        parts: SimulationParts,
        runner: Callable[[InProcessSimulation], RoundRunner] | None = None,
        clients: Callable[[InProcessSimulation], ClientPool] | None = None,
    ):
        if not isinstance(parts, SimulationParts):
            raise TypeError(
                f"InProcessSimulation takes the parts shoal.assembly builds, not a {type(parts).__name__}: "
                "InProcessSimulation.from_config(cfg, data, task) builds them"
            )
        self.parts = parts
        self.cfg = cfg = parts.cfg
        self.device, self.task, self.data = parts.device, parts.task, parts.data
        self.shards, self.test, self.client_test = parts.shards, parts.test, parts.client_test
        self.client_ids = parts.client_ids
        self.trainer, self.program, self.batched = parts.trainer, parts.client.program, parts.client.batched
        self.spec = parts.spec
        self.states, self.control, self.rounds = parts.states, parts.control, parts.rounds
        self.privacy, self.wire = parts.privacy, parts.wire
        self.fed_eval_clients = parts.fed_eval_clients
        # train -> client state -> (the client steps: attack, DP share, wire) -> settle
        self.pipeline = ClientPipeline(self.program, self.states, self.batched)
        self.num_classes: int | None = getattr(self.task, "num_classes", None)
        self._index = {cid: i for i, cid in enumerate(self.client_ids)}
        self.client_steps: list[ClientStep] = self._client_steps()
        self.participants: set[str] = set()  # every client that trained in some round
        self.clients: ClientPool = (clients or LocalClients)(self)
        # the round runner the parts name (shoal.assembly chose it), unless one is passed
        self.runner: RoundRunner = (runner or RUNNERS[parts.runner])(self)
        # secure aggregation's runner: it keeps the last round's protocol outcome (``last``)
        self.secure_aggregation: SecureAggregationRounds | None = None
        if cfg.secure_aggregation.enabled and isinstance(self.runner, SecureAggregationRounds):
            self.secure_aggregation = self.runner
        log.info(
            "simulation: %d clients, %d train examples, model of %d exchanged parameters on %s (%s)",
            len(self.client_ids),
            self.shards.total_examples(),
            self.spec.numel,
            self.device,
            self.task_label,
        )

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        data: SimulationData | Population | None = None,
        task: Task | None = None,
        runner: Callable[[InProcessSimulation], RoundRunner] | None = None,
        clients: Callable[[InProcessSimulation], ClientPool] | None = None,
    ) -> InProcessSimulation:
        """The simulation of ``cfg``: its parts built by shoal.assembly (``data`` and ``task``
        default to the config's task and that task's data)."""
        return cls(assembly.build(cfg, task, "simulation", data=data), runner, clients)

    def client_index(self, client_id: str) -> int:
        """The position of ``client_id`` in the task's clients (its data's index)."""
        return self._index[client_id]

    def local_state(self, client_id: str) -> dict[str, torch.Tensor]:
        """The buffers ``client_id`` keeps between its rounds (FedBN; empty when the task exchanges them)."""
        state = self.states.get(client_id)
        initial = self.program.initial_buffers
        return {n: state.get(f"buffer/{n}", initial[n]) for n in self.trainer.local_names}

    @property
    def local_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every client that trained: its local buffers (FedBN)."""
        if not self.trainer.local_names:
            return {}
        return {c: self.local_state(c) for c in sorted(self.participants) if c in self.states}

    def client_state(self, client_id: str) -> State:
        """What ``client_id`` kept from its last round (empty when the algorithm keeps nothing)."""
        return self.pipeline.state_of(client_id)

    def broadcast(self) -> State:
        """What the server sends with the model this round (SCAFFOLD's control variate)."""
        return self.control.broadcast() if self.control is not None else {}

    def keep_result(self, client_id: str, result: ClientResult) -> Update:
        """Store the client's new state (or hold it until the round settles, SCAFFOLD); its update."""
        return self.pipeline.keep(client_id, result)

    def held_to_server(self, client_id: str) -> State:
        """The live ``to_server`` of ``client_id``'s held result (empty when none is held): secure
        aggregation masks it and puts the round's unmasked share of the sum in its place."""
        return self.pipeline.held_to_server(client_id)

    def settle(self, accepted: set[str] | None) -> None:
        """Close the round for the algorithm: the accepted clients' held state is kept and their
        ``to_server`` reaches the server's step; the others' is dropped (``None``: none accepted)."""
        kept = self.pipeline.settle(accepted)
        if self.control is not None:
            for to_server in kept:
                self.control.add(to_server)
            self.control.step()

    @property
    def task_label(self) -> str:
        describe = getattr(self.task, "describe", None)
        return describe() if callable(describe) else (self.cfg.task.app or type(self.task).__name__)

    @property
    def global_params(self) -> torch.Tensor:
        return self.rounds.global_params

    def _client_steps(self) -> list[ClientStep]:
        """The client-side steps the config asks for, in pipeline order (DESIGN.md): the simulated
        attack, then the parts' distributed-DP noise share (built sized, shoal.assembly), the wire."""
        noise = [self.parts.noise] if self.parts.noise is not None else []
        return [*attack_steps(self), *noise, self.wire]

    def train_clients(
        self, tasks: list[Assignment], global_params: torch.Tensor
    ) -> Iterator[tuple[Assignment, Update]]:
        """Local training of each task's client from ``global_params``, by ``self.clients``."""
        self.participants.update(t.client_id for t in tasks)
        return self.clients.train(tasks, global_params)

    def submit_clients(
        self, tasks: list[Assignment], global_params: torch.Tensor
    ) -> Callable[[], list[tuple[Assignment, Update]]]:
        """Start the local training of ``tasks``; returns a function that gives the results. A pool
        that trains elsewhere (``submit``: the Ray engine) works meanwhile; here it is done at once."""
        submit = getattr(self.clients, "submit", None)
        if submit is not None:
            self.participants.update(t.client_id for t in tasks)
            return submit(tasks, global_params)
        results = list(self.train_clients(tasks, global_params))
        return lambda: results

    def apply_client_steps(self, task: Assignment, update: Update) -> Update | None:
        """The client steps in order; None (counted) when validation refuses the payload."""
        try:
            for step in self.client_steps:
                update = step(task, update)
        except WireError as e:  # validation rejected the payload: counted, not aggregated
            self.rounds.rejected[e.code] = self.rounds.rejected.get(e.code, 0) + 1
            log.debug("update of %s rejected: %s", task.client_id, e)
            return None
        return update

    def run_round(self) -> RoundSummary:
        """One synchronous round: select, train the selected clients, aggregate what the
        round runner delivers; a round the runner aborts leaves the model as it was."""
        tasks = self.rounds.start_round(self.client_ids)
        self.wire.broadcast(self.rounds.global_params, self.rounds.version, len(tasks))
        # a SummingRunner (virtual edges hand over updates instead when they say summing = False)
        summed = getattr(self.runner, "partial_sums", None) if getattr(self.runner, "summing", True) else None
        try:
            if summed is not None:
                for part in summed(tasks, self.rounds.global_params):
                    self.rounds.submit_sum(part)
            else:
                for task, update in self.runner.updates(tasks, self.rounds.global_params):
                    try:
                        self.rounds.submit(task.client_id, update)
                    except Exception:
                        self.wire.not_accepted(task.client_id)  # top-k error feedback keeps what was refused
                        raise
        except SecAggAborted as e:
            return self._abort_round(str(e))
        try:
            summary = self.rounds.finish_round()
        except Exception:
            for cid in self.rounds.received:
                self.wire.not_accepted(cid)
            self.settle(None)
            raise
        self.settle(None if summary.failed else set(self.rounds.received))
        for cid in self.rounds.received:  # applied (or, in a failed round, dropped): settle error feedback
            (self.wire.not_accepted if summary.failed else self.wire.accepted)(cid)
        if self.privacy is not None:
            self.privacy.record_round(tasks)
        return summary

    def _abort_round(self, why: str) -> RoundSummary:
        """Where the accountant prices aborts as released (PrivacyBudget.aborts_released: distributed DP,
        Poisson sampling) the aborted round is released as one that selected nobody (its noise alone, a
        new version), as `shoal server` does: whether a round aborts depends on the sample
        (shoal.accounting_aborts). Otherwise (a fixed-size sample, whose size does not depend on the
        data) the model stays."""
        empty = self.privacy is not None and self.privacy.aborts_released
        log.warning(
            "round %d aborted, %s: %s",
            self.rounds.round,
            "released as an empty round" if empty else "model unchanged",
            why,
        )
        if self.secure_aggregation is not None:
            self.secure_aggregation.last = {"aborted": why}
        if self.privacy is not None:  # charged like any round that started (docs/privacy.md)
            self.privacy.record_round([])
        for cid in self.rounds.selected:  # nothing was applied: error feedback keeps it all
            self.wire.not_accepted(cid)
        self.settle(None)
        return self.rounds.finish_empty() if empty else self.rounds.abort_round()

    def steps(self) -> Iterator[Step]:
        """``simulation.rounds`` rounds (fewer when the privacy budget runs out), as run-loop steps:
        a record after every ``eval_every``-th round, the last and the one that exhausts the budget."""
        sim_cfg = self.cfg.simulation
        for r in range(1, sim_cfg.rounds + 1):
            summary = self.run_round()
            stop = self.privacy is not None and not self.privacy.allows_next_round()
            record = None
            if evaluation_due(r, sim_cfg.eval_every, sim_cfg.rounds, stop):
                record = {
                    "round": summary.round,
                    "version": summary.version,
                    **self.evaluate(),
                    "train_loss": summary.train_loss,
                    "num_results": summary.num_results,
                    "num_examples": summary.num_examples,
                    **self.wire.counts(),
                    "rejected": summary.rejected,
                }
                if self.privacy is not None:  # the run loop leaves out what privacy.release withholds
                    record.update(self.privacy.metrics(), **self.privacy.round_figures(summary))
                record.update(self.runner_figures("round_fields"))  # e.g. virtual edges' per-tier figures
            yield Step(1, record)
            if stop:
                return

    # --- the Engine the run loop drives (simulations/run_loop.py) ---------------------------

    x_axis = "round"

    @property
    def label(self) -> str:
        return self.task_label

    @property
    def title(self) -> str:
        return f"{self.task_label} / {self.cfg.strategy.name}"

    def drive(self, report: Report) -> None:
        for step in self.steps():
            report(step)

    def close(self) -> None:
        """Stop the client pool's workers, if it has any (the Ray engine's)."""
        close = getattr(self.clients, "close", None)
        if callable(close):
            close()

    def figures(self, last: dict | None = None) -> dict:
        """This run's figures for summary.json."""
        out = {
            "rounds": self.rounds.version,
            "num_clients": len(self.client_ids),
            "num_parameters": self.spec.numel,
            "device": str(self.device),
            "bytes_up_total": self.wire.total_up,
            "bytes_down_total": self.wire.total_down,
        }
        if self.privacy is not None:
            out.update(self.privacy.summary())  # epsilon, delta, the sampling and the accountant
        out.update(self.pool_figures())
        out.update(self.runner_figures("figures"))
        return out

    def runner_figures(self, name: str) -> dict:
        """What the round runner says of itself (``round_fields``: this round; ``figures``: totals)."""
        figures = getattr(self.runner, name, None)
        return figures() if callable(figures) else {}

    def pool_figures(self) -> dict:
        """What the client pool says of itself for summary.json (the Ray engine: its workers)."""
        figures = getattr(self.clients, "figures", None)
        return figures() if callable(figures) else {}

    def evaluate(self, params: torch.Tensor | None = None) -> dict[str, float]:
        """``params`` (default: the global model) on the central test set (``test_<metric>``)
        and, when clients have test data, on each client's own (``fed_<metric>``, example-weighted)."""
        params = self.rounds.global_params if params is None else params
        out: dict[str, float] = {}
        if self.test is not None:
            ev = self.trainer.evaluate_data(params, self.test)
            out.update({f"test_{k}": v for k, v in ev.items() if k != "num_examples"})
        if (self.client_test is not None or self.fed_eval_clients) and plan_of(self.cfg).client_evaluations:
            out.update(self.federated_evaluate(params))  # under DP (release not clear) never written: not computed
        return out

    def _client_tests(self) -> Iterator[tuple[str, ClientData | None]]:
        """(client id, its test data): every client's held data, or a population's evaluation sample."""
        if self.client_test is not None:
            yield from zip(self.client_ids, self.client_test)
        elif isinstance(self.shards, PopulationShards):
            for i in self.fed_eval_clients:
                yield self.client_ids[i], self.shards.test_data(i)

    def federated_evaluate(self, params: torch.Tensor) -> dict[str, float]:
        """Every client with test data evaluates ``params`` (with its own local buffers); in a
        population, the clients of ``fed_eval_clients``."""
        results, personal = [], []
        steps = self.cfg.algorithm.personal_eval_steps
        for cid, data in self._client_tests():
            if data is None:
                continue
            state = self.client_state(cid)
            self.program.load_buffers(state)
            results.append(self.trainer.evaluate_data(params, data, summarize=False))
            if steps >= 0:
                i = self._index[cid]
                seed = derive_seed(self.cfg.simulation.seed, i, self.rounds.version)
                tuned = self.program.fine_tuned(self.shards.data(i), params, state, steps, seed)
                personal.append(self.trainer.evaluate_data(tuned, data, summarize=False))
        out = {f"fed_{k}": v for k, v in weighted_means(results, self.task).items()}
        out.update({f"fed_personal_{k}": v for k, v in weighted_means(personal, self.task).items()})
        return out


# the round runner of each kind shoal.assembly may choose (SimulationParts.runner)
RUNNERS: dict[str, Callable[[InProcessSimulation], RoundRunner]] = {
    "plain": PlainRound,
    "secure_aggregation": SecureAggregationRounds,
    "edges": HierarchicalRound,
}


def weighted_means(results: list[dict[str, float]], task: Task | None = None) -> dict[str, float]:
    """Example-weighted means of clients' raw metric means (each dict carries ``num_examples``),
    then ``task.summarize`` once on the pooled means; the example total too."""
    total = sum(r.get("num_examples", 0.0) for r in results)
    if not results or total <= 0:
        return {}
    keys = [k for k in results[0] if k != "num_examples"]
    out = {k: sum(r[k] * r["num_examples"] for r in results if k in r) / total for k in keys}
    if task is not None:
        out = summarize_means(task, out)
    out["num_examples"] = total
    return out
