"""The config's sections: one dataclass per TOML table, each checking its own keys, and
:class:`Config`, the whole config.

The sections live by family: ``training.py`` (what a client does: [simulation], [task], [data],
[model], [train], [strategy], [algorithm], [robust], [attack], [compression], [heterogeneity],
[output]), ``network.py`` (how clients meet: [server], [asynchronous], [federation],
[hierarchy], [gossip]) and ``privacy.py`` ([privacy], [secure_aggregation]); the checks they
share are in ``checks.py``. Allowed choices are declared once, as ``Literal`` types on the fields:
the loader's type check, :func:`check_choices`, error messages and the factories
(:func:`choices`) read them from there. Settings that are fine alone but not together are checked
in ``rules.py``. Every name stays importable from here and from ``shoal.config``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from shoal.algorithms import AlgorithmName

from .checks import INFINITE_ALLOWED, check_choices, check_finite, choices, positive
from .network import AsynchronousConfig, FederationConfig, GossipConfig, HierarchyConfig, ServerConfig
from .privacy import MIN_SECURE_INPUTS, PRIVACY_MODES, PrivacyConfig, PrivacyMode, SecureAggregationConfig
from .rules import check_combinations
from .training import (
    AlgorithmConfig,
    AttackConfig,
    CompressionConfig,
    DataConfig,
    HeterogeneityConfig,
    ModelConfig,
    OutputConfig,
    RobustConfig,
    SimulationConfig,
    StrategyConfig,
    TaskConfig,
    TrainConfig,
)

__all__ = [
    "INFINITE_ALLOWED",
    "MIN_SECURE_INPUTS",
    "PRIVACY_MODES",
    "AlgorithmConfig",
    "AlgorithmName",
    "AsynchronousConfig",
    "AttackConfig",
    "CompressionConfig",
    "Config",
    "DataConfig",
    "FederationConfig",
    "GossipConfig",
    "HeterogeneityConfig",
    "HierarchyConfig",
    "ModelConfig",
    "OutputConfig",
    "PrivacyConfig",
    "PrivacyMode",
    "RobustConfig",
    "SecureAggregationConfig",
    "ServerConfig",
    "SimulationConfig",
    "StrategyConfig",
    "TaskConfig",
    "TrainConfig",
    "check_choices",
    "check_finite",
    "choices",
    "positive",
]


@dataclass
class Config:
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    robust: RobustConfig = field(default_factory=RobustConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    asynchronous: AsynchronousConfig = field(default_factory=AsynchronousConfig)
    heterogeneity: HeterogeneityConfig = field(default_factory=HeterogeneityConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    gossip: GossipConfig = field(default_factory=GossipConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    secure_aggregation: SecureAggregationConfig = field(default_factory=SecureAggregationConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)

    def validate(self) -> Config:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            check_choices(section, f.name)
            check_finite(section, f.name)
            if hasattr(section, "validate"):
                section.validate()
        check_combinations(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
