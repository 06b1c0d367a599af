"""One client step per algorithm: local training from the global model, with the client's state.

A :class:`ClientProgram` turns (the global model, the server's broadcast, the client's state
from a ``ClientState`` store, its data) into the update it sends, the state it keeps and what
the server's step needs beside the update. The in-process simulator and the Ray engine's
workers call the same objects; the server halves live in aggregation/ (scaffold.py,
fednova.py, feddyn.py). Equations are cited from each paper.

State names: ``buffer/<name>`` (FedBN's local BatchNorm statistics), ``scaffold/c``,
``feddyn/grad``, ``ditto/v``, ``personal`` (the FedPer / FedRep personal entries),
``optimizer/momentum`` (algorithm.keep_optimizer_state).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from shoal.algorithms import algorithm, algorithm_of
from shoal.client.batched import BatchedTrainer, BatchTerms
from shoal.client.state import State
from shoal.client.training import LocalTrainer, Objective
from shoal.config import Config
from shoal.errors import ConfigError
from shoal.params import ParamSpec
from shoal.rounds import Assignment
from shoal.seeding import derive_seed
from shoal.task import LOSS_PART, ClientData, Task, task_name, user_batches
from shoal.update import Update

log = logging.getLogger(__name__)

_PERSONAL_STREAM = 0xD177  # seeds a client's personal training apart from its global one
_FINE_TUNE_STREAM = 0xF17E  # seeds personalised evaluation's fine-tuning


@dataclass
class ClientResult:
    """What one client's step gives: the ``update`` it sends, the ``state`` it keeps (the whole new
    state: it replaces the old one) and ``to_server``: tensors the server's step needs beside the
    update (SCAFFOLD's control-variate delta)."""

    update: Update
    state: State = field(default_factory=dict)
    to_server: State = field(default_factory=dict)


def personal_mask(spec: ParamSpec, personal: tuple[str, ...] | list[str]) -> torch.Tensor:
    """Bool mask over the flat buffer: the entries named by ``personal`` (a name, or a module
    prefix such as ``head`` for ``head.weight``)."""
    mask = torch.zeros(spec.numel, dtype=torch.bool)
    for e in spec.entries:
        if any(e.name == p or e.name.startswith(p.rstrip(".") + ".") for p in personal):
            mask[e.offset : e.offset + e.numel] = True
    return mask


class ClientProgram:
    """FedAvg's client (and FedProx's, with train.prox_mu): E epochs of local SGD from the global
    model (McMahan et al. 2017, Algorithm 1, ClientUpdate); FedBN's buffers stay in the state."""

    name = "fedavg"

    def __init__(self, trainer: LocalTrainer, cfg: Config, task: Task | None = None):
        self.declared = algorithm(self.name)  # what the registry says this algorithm is and runs with
        self.trainer = trainer
        self.cfg = cfg
        self.device = trainer.flat.device
        self.initial_buffers: State = trainer.local_state()  # a client's buffers before its first round
        self.keep_optimizer = cfg.algorithm.keep_optimizer_state

    @functools.cached_property
    def trainable(self) -> torch.Tensor:
        """Float 0/1 over the flat buffer: 1 where the entry is trainable (made when an algorithm
        first asks: plain FedAvg never holds this model-sized mask)."""
        return self.trainer._train_mask.to(self.device).float()

    @property
    def settles(self) -> bool:
        """True: the new state may be kept only if the server accepted the update (state the server
        mirrors, such as SCAFFOLD's c = mean of c_i)."""
        return self.declared.settles

    @property
    def batchable(self) -> bool:
        """The local step is plain SGD plus per-client terms (:meth:`objective`), so the batched
        trainer can run many clients of it at once (:func:`train_batched`)."""
        return self.declared.batchable

    @property
    def keeps_state(self) -> bool:
        """Whether clients keep anything between rounds (else the store is never read)."""
        return self.declared.stateful or bool(self.trainer.local_names) or self.keep_optimizer

    def fit(
        self, data: ClientData, task: Assignment, global_flat: torch.Tensor, state: State, broadcast: State
    ) -> ClientResult:
        """One round of this client (its buffers loaded from ``state`` first, saved after)."""
        trainer = self.trainer
        if trainer.local_names:
            saved = {n: state[f"buffer/{n}"] for n in trainer.local_names if f"buffer/{n}" in state}
            trainer.load_local_state({**self.initial_buffers, **saved})
        if self.keep_optimizer:
            trainer.set_momentum(state.get("optimizer/momentum"))
        result = self.local(data, task, global_flat.to(self.device), state, broadcast)
        for n, t in trainer.local_state().items():
            result.state[f"buffer/{n}"] = t
        momentum = trainer.momentum() if self.keep_optimizer else None
        if momentum is not None:
            result.state["optimizer/momentum"] = momentum
        return result

    def local(
        self, data: ClientData, task: Assignment, global_flat: torch.Tensor, state: State, broadcast: State
    ) -> ClientResult:
        obj = self.objective(global_flat, state, broadcast)
        update = self.trainer.fit(global_flat, data, task.seed, task.version, task.client_id, objective=obj)
        return self.finish(update, state, broadcast)

    def objective(self, global_flat: torch.Tensor, state: State, broadcast: State) -> Objective | None:
        """What the algorithm adds to this client's local SGD (None: nothing)."""
        return None

    def finish(self, update: Update, state: State, broadcast: State) -> ClientResult:
        """The client's result from its trained update: new state, what the server needs."""
        return ClientResult(update)

    def batch_terms(self, global_flat: torch.Tensor, states: list[State], broadcast: State) -> BatchTerms | None:
        """:meth:`objective` of each client, stacked for the batched trainer (None: plain SGD)."""
        objs = [self.objective(global_flat, s, broadcast) for s in states]
        given = [o for o in objs if o is not None]
        if not given:
            return None
        if len(given) < len(objs):
            raise ValueError("an algorithm's objective is given for some clients of a batch and not others")

        def rows(name: str) -> torch.Tensor | None:
            values = [getattr(o, name) for o in given]
            return None if values[0] is None else torch.stack([v.to(self.device) for v in values])

        return BatchTerms(rows("correction"), rows("drift"), given[0].prox_mu)

    def broadcast(self) -> State:
        """Nothing beside the model (the server's step object gives SCAFFOLD's c)."""
        return {}

    def personal_model(self, global_flat: torch.Tensor, state: State) -> torch.Tensor:
        """The model this client would use itself: the global one, unless it keeps a personal part."""
        return global_flat

    @property
    def tune_mask(self) -> torch.Tensor | None:
        """What personalised evaluation's fine-tuning may move (None: every trainable entry)."""
        return None

    def load_buffers(self, state: State) -> None:
        """This client's local buffers (FedBN) into the model, before evaluating its model."""
        if self.trainer.local_names:
            saved = {n: state[f"buffer/{n}"] for n in self.trainer.local_names if f"buffer/{n}" in state}
            self.trainer.load_local_state({**self.initial_buffers, **saved})

    def fine_tuned(
        self, data: ClientData, global_flat: torch.Tensor, state: State, steps: int, seed: int
    ) -> torch.Tensor:
        """Personalised evaluation's model: :meth:`personal_model` after ``steps`` steps of local
        SGD on the client's own training data (0: as it is)."""
        start = self.personal_model(global_flat.to(self.device), state)
        self.load_buffers(state)
        if steps <= 0:
            return start.clone()
        obj = Objective(start=start, anchor=start, prox_mu=0.0, mask=self.tune_mask, epochs=steps, max_steps=steps)
        self.trainer.fit(global_flat, data, derive_seed(seed, _FINE_TUNE_STREAM), objective=obj)
        return self.trainer.flat.detach().clone()


class Scaffold(ClientProgram):
    """SCAFFOLD (Karimireddy et al. 2020, Algorithm 1, option II).

    Local step (line 10): ``y <- y - eta_l (g_i(y) - c_i + c)``. After K steps (line 12,
    option II): ``c_i+ = c_i - c + (x - y) / (K eta_l)``. The client sends ``Delta y = y - x``
    and ``Delta c_i = c_i+ - c_i`` (line 13); the server (aggregation/scaffold.py) applies
    ``x <- x + eta_g mean(Delta y)`` and ``c <- c + (1/N) sum Delta c_i``. With train.momentum
    the correction is added to each step after the momentum, as NIID-Bench's implementation
    does: option II's c's are measured on momentum steps (about 1/(1 - rho) times the
    gradient), so passing them through the momentum again amplified them by 1/(1 - rho) and
    diverged (measured: MNIST, rho = 0.9, test loss 1.6e8 by round 3)."""

    name = "scaffold"

    def _cs(self, state: State, broadcast: State) -> tuple[torch.Tensor, torch.Tensor]:
        c = broadcast["scaffold/c"].to(self.device)
        ci = state.get("scaffold/c")
        return c, (torch.zeros_like(c) if ci is None else ci.to(self.device))

    def objective(self, global_flat, state, broadcast) -> Objective:
        c, ci = self._cs(state, broadcast)
        return Objective(drift=c - ci)

    def finish(self, update, state, broadcast) -> ClientResult:
        c, ci = self._cs(state, broadcast)
        k = max(update.metrics.get("local_steps", 0.0), 1.0)
        ci_new = (ci - c - update.delta / (k * self.cfg.train.lr)) * self.trainable
        return ClientResult(update, {"scaffold/c": ci_new}, {"scaffold/dc": ci_new - ci})


class FedNova(ClientProgram):
    """FedNova (Wang et al. 2020): the client reports ``||a_i||_1``, the weight its local steps give
    the gradients, so the server can normalise (aggregation/fednova.py). For SGD with momentum
    rho over tau steps (the paper's Appendix, eq. for momentum SGD):
    ``||a_i||_1 = (tau - rho (1 - rho^tau) / (1 - rho)) / (1 - rho)``; for plain SGD, tau."""

    name = "fednova"

    def finish(self, update, state, broadcast) -> ClientResult:
        update.metrics["fednova_a"] = fednova_norm(update.metrics.get("local_steps", 0.0), self.cfg.train.momentum)
        return ClientResult(update)


def fednova_norm(tau: float, rho: float) -> float:
    """``||a||_1`` of tau steps of SGD with momentum rho (Wang et al. 2020); at least 1."""
    if tau <= 0:
        return 1.0
    if rho == 0:
        return float(tau)
    return (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho)


class FedDyn(ClientProgram):
    """FedDyn (Acar et al. 2021, Algorithm 1). The client minimises
    ``L_k(theta) - <grad_k, theta> + (alpha/2) ||theta - theta^{t-1}||^2`` (line 5), then
    ``grad_k <- grad_k - alpha (theta_k^t - theta^{t-1})`` (line 6), with ``grad_k = 0`` at first.
    The server step (h and the correction of the mean) is aggregation/feddyn.py."""

    name = "feddyn"

    def _g(self, state: State, like: torch.Tensor) -> torch.Tensor:
        g = state.get("feddyn/grad")
        return torch.zeros_like(like) if g is None else g.to(self.device)

    def objective(self, global_flat, state, broadcast) -> Objective:
        return Objective(correction=-self._g(state, global_flat), prox_mu=self.cfg.algorithm.feddyn_alpha)

    def finish(self, update, state, broadcast) -> ClientResult:
        g = self._g(state, update.delta)
        g_new = g - self.cfg.algorithm.feddyn_alpha * update.delta * self.trainable
        return ClientResult(update, {"feddyn/grad": g_new})


class Ditto(ClientProgram):
    """Ditto (Li et al. 2021, Algorithm 1). The global model trains as FedAvg's (lines 4-5, the update
    sent); the personal model ``v_k`` takes ``personal_epochs`` epochs of
    ``v_k <- v_k - eta (grad F_k(v_k) + lambda (v_k - w^t))`` (line 7) from the global model
    ``w^t`` the round began with, and never leaves the client. ``v_k`` starts as the global model
    the client first receives."""

    name = "ditto"  # two trainings a round (the global model's and the personal one): not batchable

    def local(self, data, task, global_flat, state, broadcast) -> ClientResult:
        a = self.cfg.algorithm
        update = self.trainer.fit(global_flat, data, task.seed, task.version, task.client_id)
        v = state.get("ditto/v")
        v = global_flat if v is None else v.to(self.device)
        obj = Objective(start=v, anchor=global_flat, prox_mu=a.ditto_lambda, epochs=a.personal_epochs)
        self.trainer.fit(global_flat, data, derive_seed(task.seed, _PERSONAL_STREAM), objective=obj)
        return ClientResult(update, {"ditto/v": self.trainer.flat.detach().clone()})

    def personal_model(self, global_flat, state):
        v = state.get("ditto/v")
        return global_flat if v is None else v.to(self.device)


class FedPer(ClientProgram):
    """FedPer (Arivazhagan et al. 2019): the base layers are federated, the personal layers (the
    task's ``personal``) stay on each client. All layers train together from (global base, own
    personal layers); the update's personal entries are zero, so the server averages the base
    only, and the client keeps its personal entries."""

    name = "fedper"  # it starts each client from its own head (a per-client start the batched trainer lacks)

    def __init__(self, trainer: LocalTrainer, cfg: Config, task: Task | None = None):
        super().__init__(trainer, cfg)
        if task is None:
            raise TypeError(f"{type(self).__name__} takes the task, whose `personal` names the personal layers")
        personal = tuple(getattr(task, "personal", ()) or ())
        self.mask = personal_mask(trainer.spec, personal).to(self.device)
        if not personal or not bool(self.mask.any()):
            raise ConfigError(
                f"algorithm.name = {self.name!r} needs the personal layers: task {task_name(task)} names "
                f"{list(personal) or 'none'} in its `personal` attribute, which matches no exchanged parameter "
                f"(e.g. personal = ('head',) for the parameters of model.head)"
            )
        self.shared = (~self.mask).float()

    def personal_model(self, global_flat, state):
        own = state.get("personal")
        if own is None:
            return global_flat
        out = global_flat.clone()
        out[self.mask] = own.to(self.device)
        return out

    def local(self, data, task, global_flat, state, broadcast) -> ClientResult:
        start = self.personal_model(global_flat, state)
        obj = Objective(start=start, anchor=start)
        update = self.trainer.fit(global_flat, data, task.seed, task.version, task.client_id, objective=obj)
        return self._split(update)

    def _split(self, update: Update) -> ClientResult:
        own = self.trainer.flat.detach()[self.mask].clone()
        update.delta = update.delta * self.shared  # the personal entries never leave
        return ClientResult(update, {"personal": own})


class FedRep(FedPer):
    """FedRep (Collins et al. 2021, Algorithm 1): first ``personal_epochs`` epochs on the personal
    head with the body fixed (line 5), then ``train.epochs`` epochs on the body with the head
    fixed (line 6); the body's change is sent, the head stays on the client."""

    name = "fedrep"

    @property
    def tune_mask(self) -> torch.Tensor | None:
        """FedRep adapts a client by its head alone (the body is the shared representation)."""
        return self.mask.float()

    def local(self, data, task, global_flat, state, broadcast) -> ClientResult:
        a = self.cfg.algorithm
        start = self.personal_model(global_flat, state)
        head = Objective(start=start, anchor=start, mask=self.mask.float(), epochs=a.personal_epochs)
        first = self.trainer.fit(global_flat, data, derive_seed(task.seed, _PERSONAL_STREAM), objective=head)
        mid = self.trainer.flat.detach().clone()
        body = Objective(start=mid, anchor=mid, mask=self.shared)
        update = self.trainer.fit(global_flat, data, task.seed, task.version, task.client_id, objective=body)
        update.metrics["local_steps"] = update.metrics.get("local_steps", 0.0) + first.metrics.get("local_steps", 0.0)
        return self._split(update)


def train_batched(
    program: ClientProgram,
    batched: BatchedTrainer,
    global_flat: torch.Tensor,
    data: tuple[torch.Tensor, torch.Tensor, list[int], list[int]],
    tasks: list[Assignment],
    states: list[State],
    broadcast: State,
) -> Iterator[tuple[int, ClientResult]]:
    """Many clients' :meth:`ClientProgram.local` at once on the batched trainer: each client's
    objective terms stacked (:meth:`ClientProgram.batch_terms`), then each trained update
    finished as one by one (``data``: x, y, starts, sizes of the clients, in ``tasks`` order).
    Yields (index into ``tasks``, result) in the trainer's order."""
    x, y, starts, sizes = data
    terms = program.batch_terms(global_flat, states, broadcast)
    trained = batched.train(global_flat, x, y, starts, sizes, [t.seed for t in tasks], terms)
    # the task's model and loss run inside (vmap over clients): their errors name the loss
    for j, update in user_batches(program.trainer.task, trained, LOSS_PART):
        update.base_version, update.sender = tasks[j].version, tasks[j].client_id
        yield j, program.finish(update, states[j], broadcast)


def program_classes() -> dict[str, type[ClientProgram]]:
    """Every client program by its class name (what a registry entry's ``program`` names)."""
    found: dict[str, type[ClientProgram]] = {}
    todo: list[type[ClientProgram]] = [ClientProgram]
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found


def make_program(cfg: Config, task: Task, trainer: LocalTrainer) -> ClientProgram:
    """The client step ``algorithm.name`` asks for: the program its registry entry declares."""
    declared = algorithm_of(cfg)
    if declared.own_sgd and task.optimizer is not None:
        raise ConfigError(
            f"algorithm.name = {declared.name!r} changes shoal's SGD step, but task {task_name(task)} trains with "
            f"the {task.optimizer} optimizer; leave the task's optimizer unset"
        )
    return program_classes()[declared.program](trainer, cfg, task)
