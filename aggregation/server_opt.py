"""Server optimizers over the flat global parameters x.

Each step takes the round's averaged client delta Δ = mean(local - global); the
pseudo-gradient of Reddi et al. 2021 ("Adaptive Federated Optimization", ICLR) is -Δ,
so every rule below moves x *along* Δ. The adaptive rules are their Algorithm 2, without
bias correction; FedAvgM is Hsu et al. 2019 ("Measuring the Effects of Non-Identical
Data Distribution for Federated Visual Classification").

``step`` never writes to ``x`` or ``Δ``: it returns a new vector, so the global model
that clients are still pulling stays intact until the caller swaps it. Optimizer state
is float32 on the device of ``x``, allocated on the first step (the size is unknown
before), and ``state_dict``/``load_state_dict`` round-trip it bit-exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from shoal.config import StrategyConfig

StateDict = dict[str, torch.Tensor | float | int]


def _check_range(name: str, value: float, low: float, high: float | None = None) -> None:
    """``low < value`` (lr, tau) or ``low <= value < high`` (decay rates)."""
    ok = low < value if high is None else low <= value < high
    if not ok:
        allowed = f"> {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{name} = {value!r} must be {allowed}")


class ServerOptimizer(ABC):
    """``x_{t+1} = step(x_t, Δ_t)`` plus the state a checkpoint must keep."""

    _buffers: tuple[str, ...] = ()

    def __init__(self, lr: float):
        _check_range("lr", lr, 0.0)
        self.lr = lr
        self.steps = 0
        self._state: dict[str, torch.Tensor] = {}

    def step(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The new global parameters; ``x`` and ``delta`` are left unchanged."""
        if delta.shape != x.shape or x.dim() != 1:
            raise ValueError(f"x {tuple(x.shape)} and delta {tuple(delta.shape)} must be equal-length vectors")
        delta = delta.to(device=x.device, dtype=torch.float32)
        for name in self._buffers:
            self._state[name] = self._buffer(name, x)
        new_x = self._step(x, delta)
        self.steps += 1
        return new_x

    def step_into(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """:meth:`step` for a ``delta`` the caller gives up (a float32 mean made for this step): an
        optimizer that can, writes the new parameters into ``delta``'s memory; ``x`` is unchanged."""
        return self.step(x, delta)

    def _buffer(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """State ``name`` on x's device: allocated on the first step, moved after a load."""
        buf = self._state.get(name)
        if buf is None:
            return self._initial(name, x)
        if buf.shape != x.shape:
            raise ValueError(f"optimizer state {name!r} has shape {tuple(buf.shape)}, x has {tuple(x.shape)}")
        return buf.to(x.device)

    def _initial(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x, dtype=torch.float32)

    @abstractmethod
    def _step(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor: ...

    def state_dict(self) -> StateDict:
        """Copies of the state (safe to write out while training goes on)."""
        return {"steps": self.steps, **{k: v.detach().clone() for k, v in self._state.items()}}

    def load_state_dict(self, state: StateDict) -> None:
        """Restore what :meth:`state_dict` returned (before the first step it holds no buffers)."""
        keys = set(state) - {"steps"}
        if "steps" not in state or keys not in (set(), set(self._buffers)):
            raise ValueError(
                f"{type(self).__name__} state has keys {sorted(state)}, "
                f"expected 'steps' and either none or all of {list(self._buffers)}"
            )
        self.steps = int(state["steps"])
        self._state = {k: torch.as_tensor(state[k], dtype=torch.float32).clone() for k in keys}


class FedAvgOpt(ServerOptimizer):
    """x <- x + lr * Δ. With lr = 1 this is FedAvg (McMahan et al. 2017): x <- mean(local)."""

    def _step(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return torch.add(x, delta, alpha=self.lr)

    def step_into(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        if delta.shape != x.shape or x.dim() != 1 or delta.dtype != torch.float32 or delta.device != x.device:
            return self.step(x, delta)
        if self.lr != 1.0:
            delta.mul_(self.lr)
        self.steps += 1
        return delta.add_(x)


class FedAvgM(ServerOptimizer):
    """Server momentum, Hsu et al. 2019: v <- beta*v + Δ; x <- x + lr*v."""

    _buffers = ("v",)

    def __init__(self, lr: float, momentum: float = 0.9):
        super().__init__(lr)
        _check_range("momentum", momentum, 0.0, 1.0)
        self.momentum = momentum

    def _step(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        v = self._state["v"].mul_(self.momentum).add_(delta)
        return torch.add(x, v, alpha=self.lr)


class _Adaptive(ServerOptimizer):
    """Reddi et al. 2021, Algorithm 2: m <- β1 m + (1-β1)Δ; v <- rule(v, Δ²);
    x <- x + lr * m / (sqrt(v) + τ), with m_{-1} = 0 and v_{-1} = τ² (the paper asks
    v_{-1} >= τ²)."""

    _buffers = ("m", "v")

    def __init__(self, lr: float, beta1: float = 0.9, tau: float = 1e-3):
        super().__init__(lr)
        _check_range("beta1", beta1, 0.0, 1.0)
        _check_range("tau", tau, 0.0)
        self.beta1 = beta1
        self.tau = tau

    def _initial(self, name: str, x: torch.Tensor) -> torch.Tensor:
        fill = self.tau**2 if name == "v" else 0.0
        return torch.full_like(x, fill, dtype=torch.float32)

    @abstractmethod
    def _update_v(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None:
        """Update the second-moment estimate ``v`` in place."""

    def _step(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        m = self._state["m"].mul_(self.beta1).add_(delta, alpha=1 - self.beta1)
        v = self._state["v"]
        self._update_v(v, delta * delta)
        return torch.addcdiv(x, m, v.sqrt().add_(self.tau), value=self.lr)


class FedAdagrad(_Adaptive):
    """v <- v + Δ² (Reddi et al. 2021, Alg. 2). With beta1 = 0 it is plain Adagrad."""

    def _update_v(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None:
        v.add_(delta_sq)


class _TwoBeta(_Adaptive):
    def __init__(self, lr: float, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3):
        super().__init__(lr, beta1, tau)
        _check_range("beta2", beta2, 0.0, 1.0)
        self.beta2 = beta2


class FedAdam(_TwoBeta):
    """v <- β2 v + (1-β2) Δ² (Reddi et al. 2021, Alg. 2)."""

    def _update_v(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None:
        v.mul_(self.beta2).add_(delta_sq, alpha=1 - self.beta2)


class FedYogi(_TwoBeta):
    """v <- v - (1-β2) Δ² sign(v - Δ²) (Reddi et al. 2021, Alg. 2; Zaheer et al. 2018):
    v grows at most additively, so one large round cannot wipe out the history."""

    def _update_v(self, v: torch.Tensor, delta_sq: torch.Tensor) -> None:
        v.addcmul_(delta_sq, torch.sign(v - delta_sq), value=-(1 - self.beta2))


def make_server_optimizer(cfg: StrategyConfig) -> ServerOptimizer:
    """The optimizer named by ``strategy.name``, with the config's hyperparameters."""
    match cfg.name:
        case "fedavg":
            return FedAvgOpt(cfg.server_lr)
        case "fedavgm":
            return FedAvgM(cfg.server_lr, cfg.server_momentum)
        case "fedadagrad":
            return FedAdagrad(cfg.server_lr, cfg.beta1, cfg.tau)
        case "fedadam":
            return FedAdam(cfg.server_lr, cfg.beta1, cfg.beta2, cfg.tau)
        case "fedyogi":
            return FedYogi(cfg.server_lr, cfg.beta1, cfg.beta2, cfg.tau)
    raise ValueError(f"strategy.name = {cfg.name!r} has no server optimizer")
