"""The algorithm registry: what each ``algorithm.name`` runs and what it runs with.

Each :class:`Algorithm` declares its client program (a class of shoal/client/algorithms.py), its
server step, what its clients send beside the update and what the server sends beside the model,
whether its clients keep state and may be trained as one batch, and which modes, privacy modes and
secure aggregation it supports. Config validation (:func:`refusal`, called by shoal/config/rules.py),
the assembly, the engines, secure aggregation's payload and the table in docs/algorithms.md read these
declarations; nothing else compares ``algorithm.name``. This module imports nothing of the project, so
the config can validate against it.

Run ``python -m shoal.algorithms`` to print the table of docs/algorithms.md (between its markers).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal

#: The values of ``algorithm.name`` (the config's field type; one per entry of :data:`ALGORITHMS`).
AlgorithmName = Literal["fedavg", "scaffold", "fednova", "feddyn", "ditto", "fedper", "fedrep"]

#: How the server turns the round's updates into the new model: the ``[strategy]`` step on the mean,
#: FedNova's normalised mean (aggregation/fednova.py) or FedDyn's corrected mean (aggregation/feddyn.py).
ServerStep = Literal["strategy", "fednova", "feddyn"]

#: What a client masks under secure aggregation beside its weighted update and weight: nothing, its
#: control-variate delta (twice the model), or nothing but its update divided by its step weight.
SecurePayloadKind = Literal["update", "control_delta", "normalised"]

ALL_MODES = frozenset({"sync", "async", "gossip"})
ALL_PRIVACY = frozenset({"none", "central", "distributed", "local"})


@dataclass(frozen=True)
class Algorithm:
    """One algorithm's declaration. The ``paper``, ``client``, ``server`` and ``kept`` texts are the
    columns of docs/algorithms.md; the rest are what the code reads."""

    name: str
    paper: str
    client: str
    server: str
    kept: str
    #: the ClientProgram subclass of shoal/client/algorithms.py that runs its client step
    program: str
    server_step: ServerStep = "strategy"
    #: the server keeps a control variate ``c``, sends it beside the model (``scaffold/c``) and moves it
    #: by the clients' ``scaffold/dc`` (aggregation/scaffold.py)
    control_variate: bool = False
    #: tensors a client sends beside its update, which the server step needs
    to_server: tuple[str, ...] = ()
    #: numbers a client reports beside its update (in the clear), which the server step needs
    reports: tuple[str, ...] = ()
    #: clients keep state between rounds (beyond FedBN buffers and kept momentum, which any may keep)
    stateful: bool = False
    #: a client's new state is kept only when the server accepted the update that carried it
    settles: bool = False
    #: many clients may train as one batch (client/batched.py)
    batchable: bool = True
    #: the server step needs only the sum of the updates, so edges and Ray workers may sum them
    summable: bool = False
    #: changes shoal's own SGD step (a task optimizer is refused)
    own_sgd: bool = True
    #: simulation.mode / server.mode it runs in
    modes: frozenset[str] = frozenset({"sync"})
    #: it runs on the virtual-clock engine (heterogeneity.enabled)
    virtual_clock: bool = False
    #: privacy.mode values it runs with
    privacy: frozenset[str] = frozenset({"none", "central", "distributed"})
    #: why central / distributed DP are refused (when they are)
    privacy_refusal: str = ""
    secure_payload: SecurePayloadKind = "update"
    #: why train.prox_mu > 0 is refused ("": allowed)
    prox_mu_refusal: str = ""
    #: why algorithm.keep_optimizer_state is refused ("": allowed)
    keep_optimizer_refusal: str = ""

    @property
    def own_server_step(self) -> bool:
        """Its server step is its own, defined on the plain mean (no robust rule, strategy.name = 'fedavg')."""
        return self.server_step != "strategy" or self.control_variate

    @property
    def secure_aggregation(self) -> bool:
        """Every algorithm runs with secure aggregation (its payload says what each client masks)."""
        return True


_TWO_TRAININGS = "it runs two local trainings a round (one momentum buffer would mix them)"

ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            "fedavg",
            "McMahan et al. 2017; FedProx (Li et al. 2020) with `train.prox_mu`",
            "E epochs of SGD from the global model",
            "the `[strategy]` step on the mean",
            "FedBN buffers (`exchange_buffers = False`)",
            program="ClientProgram",
            summable=True,
            own_sgd=False,
            modes=ALL_MODES,
            virtual_clock=True,
            privacy=ALL_PRIVACY,
        ),
        Algorithm(
            "scaffold",
            "Karimireddy et al. 2020, option II",
            "`y <- y - lr (g(y) - c_i + c)` (with momentum, `c - c_i` is added after the momentum); "
            "`c_i+ = c_i - c + (x - y)/(K lr)`; sends `y - x` and `c_i+ - c_i`",
            "`x <- x + strategy.server_lr * mean(y - x)` (weighted as `strategy.weighting` says; the paper's is "
            "uniform); `c <- c + (1/N) sum(c_i+ - c_i)` over accepted clients",
            "`c_i`",
            program="Scaffold",
            control_variate=True,
            to_server=("scaffold/dc",),
            stateful=True,
            settles=True,
            privacy=frozenset({"none"}),
            privacy_refusal="each client's control-variate delta is a second release of its data that the DP mean "
            "neither clips nor noises",
            secure_payload="control_delta",
        ),
        Algorithm(
            "fednova",
            "Wang et al. 2020",
            "reports `a_i = (tau - rho (1 - rho^tau)/(1 - rho))/(1 - rho)` for tau steps with momentum rho "
            "(tau without momentum)",
            "`x <- x + tau_eff * sum p_i Delta_i / a_i`, `tau_eff = sum p_i a_i`",
            "nothing",
            program="FedNova",
            server_step="fednova",
            reports=("fednova_a",),
            privacy=frozenset({"none"}),
            privacy_refusal="the normaliser rescales each clipped update by its client's step count, so the noise "
            "no longer matches the sensitivity",
            secure_payload="normalised",
            prox_mu_refusal="FedNova's normaliser here is that of SGD with momentum (no proximal term)",
            keep_optimizer_refusal="FedNova's normaliser assumes momentum starts at zero",
        ),
        Algorithm(
            "feddyn",
            "Acar et al. 2021",
            "minimises `L(theta) - <g_k, theta> + (alpha/2)\\|theta - theta^{t-1}\\|^2`, then "
            "`g_k <- g_k - alpha (theta_k - theta^{t-1})`",
            "`h <- h - alpha (\\|P\\|/N) mean(Delta)`, `theta <- theta + mean(Delta) - h/alpha`",
            "`g_k`",
            program="FedDyn",
            server_step="feddyn",
            stateful=True,
            privacy=frozenset({"none"}),
            privacy_refusal="FedDyn's server step over the DP mean is not wired (its client regulariser would also "
            "see unclipped state)",
            prox_mu_refusal="the algorithm sets its own proximal term",
        ),
        Algorithm(
            "ditto",
            "Li et al. 2021",
            "the FedAvg update (sent), then `personal_epochs` epochs of `v <- v - lr (grad F(v) + lambda (v - w))` "
            "on its personal model",
            "FedAvg",
            "`v_k` (starts as the first global model received)",
            program="Ditto",
            stateful=True,
            batchable=False,
            prox_mu_refusal="the algorithm sets its own proximal term",
            keep_optimizer_refusal=_TWO_TRAININGS,
        ),
        Algorithm(
            "fedper",
            "Arivazhagan et al. 2019",
            "trains body and its own head together; sends the body's change",
            "FedAvg of the body",
            "the personal head",
            program="FedPer",
            stateful=True,
            batchable=False,
        ),
        Algorithm(
            "fedrep",
            "Collins et al. 2021",
            "`personal_epochs` epochs on the head (body fixed), then `train.epochs` on the body (head fixed); "
            "sends the body's change",
            "FedAvg of the body",
            "the personal head",
            program="FedRep",
            stateful=True,
            batchable=False,
            keep_optimizer_refusal=_TWO_TRAININGS,
        ),
    )
}


def algorithm(name: str) -> Algorithm:
    """The declaration of ``algorithm.name = name`` (KeyError names the known ones)."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise KeyError(f"no algorithm {name!r}; known: {', '.join(ALGORITHMS)}") from None


def algorithm_of(cfg: Any) -> Algorithm:
    """The declaration of a config's ``[algorithm] name``."""
    return algorithm(cfg.algorithm.name)


def refusal(cfg: Any) -> str | None:
    """Why the config's algorithm cannot run with the rest of the config (None: it can); the
    config rules raise it as ``algorithm.name = NAME with WHY``."""
    a, sim, p = algorithm_of(cfg), cfg.simulation, cfg.privacy.mode
    if sim.mode not in a.modes:
        return (
            f"simulation.mode = {sim.mode!r}: the algorithm's client state and server step assume a client trains "
            "from the round's model and its result belongs to that round (stale results would apply control "
            "variates or regularisers of another model)"
        )
    if cfg.heterogeneity.enabled and not a.virtual_clock:
        return "heterogeneity.enabled = true: the virtual-clock engine does not carry client state yet"
    if p == "local" and p not in a.privacy:
        return "privacy.mode = 'local': the DP-SGD trainer (Opacus) does not take the algorithm's local objective"
    if a.own_server_step and cfg.robust.rule != "mean":
        return f"robust.rule = {cfg.robust.rule!r}: the algorithm's server step is defined on the mean of updates"
    if p not in a.privacy:
        return f"privacy.mode = {p!r}: {a.privacy_refusal}"
    if a.own_server_step and cfg.strategy.name != "fedavg":
        return (
            f"strategy.name = {cfg.strategy.name!r}: the algorithm has its own server step (strategy.name = 'fedavg')"
        )
    if cfg.train.prox_mu and a.prox_mu_refusal:
        return f"train.prox_mu > 0: {a.prox_mu_refusal}"
    return None


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def render() -> str:
    """The two tables of docs/algorithms.md: what each algorithm does, and what it runs with."""
    lines = [
        "| `algorithm.name` | paper | the client | the server | kept per client |",
        "|---|---|---|---|---|",
    ]
    for a in ALGORITHMS.values():
        name = f"`{a.name}`" + (" (default)" if a.name == "fedavg" else "")
        lines.append(f"| {name} | {a.paper} | {a.client} | {a.server} | {a.kept} |")
    lines += [
        "",
        "| `algorithm.name` | modes | privacy modes | secure aggregation masks | sends beside the update "
        "| batched training | edges / Ray partial sums |",
        "|---|---|---|---|---|---|---|",
    ]
    masks = {"update": "the update", "control_delta": "the update and `Delta c_i`", "normalised": "`Delta_i / a_i`"}
    for a in ALGORITHMS.values():
        modes = ", ".join(m for m in ("sync", "async", "gossip") if m in a.modes)
        modes += "" if a.virtual_clock else " (not on the virtual clock)"
        privacy = ", ".join(m for m in ("none", "central", "distributed", "local") if m in a.privacy)
        extra = ", ".join(f"`{t}`" for t in (*a.to_server, *a.reports)) or "nothing"
        lines.append(
            f"| `{a.name}` | {modes} | {privacy} | {masks[a.secure_payload]} | {extra} | {_yes(a.batchable)} "
            f"| {_yes(a.summable)} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
