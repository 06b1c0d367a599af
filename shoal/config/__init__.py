"""Experiment and service configuration: dataclasses read from TOML.

``sections``: one dataclass per table (their keys, defaults, choices and checks);
``rules``: settings that cannot go together; ``loader``: TOML, ``--set`` overrides and
type checks. Everything a caller needs is importable from ``shoal.config``.
"""

from .loader import config_from_dict, load_config, parse_override
from .sections import (
    AlgorithmConfig,
    AsynchronousConfig,
    AttackConfig,
    CompressionConfig,
    Config,
    DataConfig,
    FederationConfig,
    GossipConfig,
    HeterogeneityConfig,
    HierarchyConfig,
    ModelConfig,
    OutputConfig,
    PrivacyConfig,
    PrivacyMode,
    RobustConfig,
    SecureAggregationConfig,
    ServerConfig,
    SimulationConfig,
    StrategyConfig,
    TaskConfig,
    TrainConfig,
    check_choices,
    choices,
)

__all__ = [
    "AlgorithmConfig",
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
    "choices",
    "config_from_dict",
    "load_config",
    "parse_override",
]
