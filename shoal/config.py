"""Experiment and service configuration: dataclasses read from TOML.

A config file has one table per section (``[simulation]``, ``[data]``, ...). Command
lines override single values with ``--set section.key=value`` (the value is read as a
TOML value, so ``--set train.lr=0.05`` is a float and ``--set data.dir=/x`` a string).
An unknown section or key, or a value of the wrong type, is a :class:`ConfigError`
that names the key and says what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} = {value!r} is not one of {', '.join(map(repr, allowed))}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key} = {value!r} must be {'>= 0' if allow_zero else '> 0'}")


@dataclass
class SimulationConfig:
    """The many-clients-on-one-machine experiment."""

    seed: int = 0
    rounds: int = 50
    num_clients: int = 30          # clients to make where the dataset has no natural split
    clients_per_round: int = 10    # K; 0 means use `fraction`
    fraction: float = 0.1          # C: a fraction of all clients each round (at least 1)
    eval_every: int = 1            # evaluate the global model every k rounds (and the last)
    engine: str = "inprocess"      # inprocess (simulations/inprocess.py) | flower (Ray, simulations/flower_engine.py)
    mode: str = "sync"             # sync rounds; other modes come with their issues
    device: str = "auto"           # where simulated clients train: auto | cpu | cuda[:N]
    progress: bool = True          # progress bar on a terminal
    flower_client_cpus: float = 1.0  # engine=flower: CPUs Ray reserves per client (Flower's default is 2)
    flower_client_gpus: float = 0.0  # engine=flower: GPU fraction per client (0.25 = four per GPU)
    ray_address: str = ""          # engine=flower: an existing Ray cluster ("auto", "ray://host:10001"); "" starts one here
    ray_num_cpus: int = 0          # engine=flower without ray_address: CPUs the local Ray runtime may use (0 = all)

    def validate(self) -> None:
        _positive("simulation.rounds", self.rounds)
        _positive("simulation.num_clients", self.num_clients)
        _positive("simulation.clients_per_round", self.clients_per_round, allow_zero=True)
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"simulation.fraction = {self.fraction} must be in (0, 1]")
        _positive("simulation.eval_every", self.eval_every)
        _choice("simulation.engine", self.engine, ("inprocess", "flower"))
        _positive("simulation.flower_client_cpus", self.flower_client_cpus)
        _positive("simulation.flower_client_gpus", self.flower_client_gpus, allow_zero=True)
        _positive("simulation.ray_num_cpus", self.ray_num_cpus, allow_zero=True)
        _choice("simulation.mode", self.mode, ("sync",))


@dataclass
class DataConfig:
    """Which dataset and how it is split into client shards."""

    dataset: str = "synthetic"     # synthetic | mnist | fashion-mnist | femnist
    dir: str = ""                  # folder of the dataset files (not needed for synthetic)
    partition: str = "natural"     # natural | iid | dirichlet | shards
    dirichlet_alpha: float = 0.5
    shards_per_client: int = 2     # McMahan's pathological non-IID split
    shard_size: int = 300
    synthetic_alpha: float = 1.0   # Synthetic(alpha, beta) of Li et al. (FedProx)
    synthetic_beta: float = 1.0
    synthetic_iid: bool = False
    test_fraction: float = 0.2     # held-out share of each synthetic client's samples
    max_clients: int = 0           # femnist: use only the first N writers (0 = all)
    verify_checksums: bool = True

    def validate(self) -> None:
        _choice("data.dataset", self.dataset, ("synthetic", "mnist", "fashion-mnist", "femnist"))
        _choice("data.partition", self.partition, ("natural", "iid", "dirichlet", "shards"))
        _positive("data.dirichlet_alpha", self.dirichlet_alpha)
        _positive("data.shards_per_client", self.shards_per_client)
        _positive("data.shard_size", self.shard_size)
        if not 0 < self.test_fraction < 1:
            raise ConfigError(f"data.test_fraction = {self.test_fraction} must be in (0, 1)")
        if self.dataset != "synthetic" and not self.dir:
            raise ConfigError(
                f"data.dir is empty: dataset {self.dataset!r} is read from files; "
                "set it in the config or with --set data.dir=PATH"
            )


@dataclass
class ModelConfig:
    name: str = "logreg"           # logreg | 2nn | cnn | femnist_cnn

    def validate(self) -> None:
        _choice("model.name", self.name, ("logreg", "2nn", "cnn", "femnist_cnn"))


@dataclass
class TrainConfig:
    """Local training on a client (the same on simulated and real nodes)."""

    epochs: int = 1                # E
    batch_size: int | float = 10   # B; `inf` (TOML) or 0 means the full local dataset
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    prox_mu: float = 0.0           # FedProx proximal term (Li et al. 2020); 0 is FedAvg
    device: str = "auto"           # auto | cpu | cuda | cuda:N (client nodes)

    def validate(self) -> None:
        _positive("train.epochs", self.epochs)
        b = self.batch_size
        if not (b == 0 or b == math.inf or (float(b).is_integer() and b > 0)):
            raise ConfigError(f"train.batch_size = {b!r} must be a positive integer, or inf for full batch")
        _positive("train.lr", self.lr)
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"train.momentum = {self.momentum} must be in [0, 1)")
        _positive("train.weight_decay", self.weight_decay, allow_zero=True)
        _positive("train.prox_mu", self.prox_mu, allow_zero=True)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"train.device = {self.device!r}: use auto, cpu, cuda or cuda:N")

    def batch(self, n: int) -> int:
        """The batch size for a client holding ``n`` examples."""
        b = self.batch_size
        return n if b == 0 or b == math.inf else min(int(b), n)


@dataclass
class StrategyConfig:
    """Server-side aggregation (Reddi et al. 2021 for the FedOpt family)."""

    name: str = "fedavg"           # fedavg | fedavgm | fedadam | fedyogi | fedadagrad
    weighting: str = "examples"    # examples (McMahan) | uniform
    server_lr: float = 1.0         # eta
    server_momentum: float = 0.9   # FedAvgM's beta
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3              # adaptivity (FedAdam/Yogi/Adagrad)

    def validate(self) -> None:
        _choice("strategy.name", self.name, ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad"))
        _choice("strategy.weighting", self.weighting, ("examples", "uniform"))
        _positive("strategy.server_lr", self.server_lr)
        _positive("strategy.tau", self.tau)
        for k in ("server_momentum", "beta1", "beta2"):
            v = getattr(self, k)
            if not 0 <= v < 1:
                raise ConfigError(f"strategy.{k} = {v} must be in [0, 1)")


@dataclass
class OutputConfig:
    dir: str = "runs/latest"
    plots: bool = True


@dataclass
class Config:
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def validate(self) -> "Config":
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate()
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _type_ok(value: Any, annotation: Any) -> tuple[bool, Any]:
    """Check (and mildly coerce: int -> float) a TOML value against a field annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(annotation):
            ok, v = _type_ok(value, arm)
            if ok:
                return True, v
        return False, value
    if origin is list:
        (inner,) = typing.get_args(annotation) or (Any,)
        if not isinstance(value, list):
            return False, value
        out = []
        for item in value:
            ok, v = _type_ok(item, inner)
            if not ok:
                return False, value
            out.append(v)
        return True, out
    if origin is dict:
        return isinstance(value, dict), value
    if annotation is Any:
        return True, value
    if annotation is bool:
        return isinstance(value, bool), value
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if annotation is str:
        return isinstance(value, str), value
    return isinstance(value, annotation), value


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _apply(section_obj: Any, section_name: str, values: dict[str, Any]) -> None:
    hints = typing.get_type_hints(type(section_obj))
    known = {f.name for f in dataclasses.fields(section_obj)}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(
                f"unknown key '{section_name}.{key}' (known keys of [{section_name}]: {', '.join(sorted(known))})"
            )
        ok, coerced = _type_ok(value, hints[key])
        if not ok:
            raise ConfigError(
                f"{section_name}.{key} = {value!r} has the wrong type: expected {_type_name(hints[key])}"
            )
        setattr(section_obj, key, coerced)


def config_from_dict(data: dict[str, Any], base: Config | None = None) -> Config:
    cfg = base or Config()
    sections = {f.name for f in dataclasses.fields(cfg)}
    for name, values in data.items():
        if name not in sections:
            raise ConfigError(f"unknown section [{name}] (known sections: {', '.join(sorted(sections))})")
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table of keys, got {values!r}")
        _apply(getattr(cfg, name), name, values)
    return cfg


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value); the value is TOML, else a string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    dotted, raw = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {text!r}: the key must look like section.key")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts[0], parts[1], value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the TOML file, then each ``--set`` override; validated."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
    cfg = config_from_dict(data)
    for text in overrides:
        section, key, value = parse_override(text)
        config_from_dict({section: {key: value}}, base=cfg)
    return cfg.validate()
