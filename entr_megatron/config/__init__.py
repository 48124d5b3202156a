"""L0: typed, validated configuration dataclasses (errors name the field and what is allowed).

A run is one `RunConfig`, read from YAML with dotted overrides by `load_config`.
"""

from entr_megatron.config.algorithm import AlgorithmConfig
from entr_megatron.config.learner import LearnerConfig, OptimConfig
from entr_megatron.config.loader import config_from_dict, dump_config, load_config, parse_value
from entr_megatron.config.run import (
    ArithmeticTaskConfig,
    CalculatorTaskConfig,
    ControllerConfig,
    EmbeddedConfig,
    LauncherConfig,
    LoggingConfig,
    MathTaskConfig,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
    RunConfig,
    SamplingConfig,
    SFTConfig,
    SGLangConfig,
    TaskConfig,
)

__all__ = [
    "AlgorithmConfig",
    "ArithmeticTaskConfig",
    "CalculatorTaskConfig",
    "ControllerConfig",
    "EmbeddedConfig",
    "LauncherConfig",
    "LearnerConfig",
    "LoggingConfig",
    "MathTaskConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SGLangConfig",
    "SamplingConfig",
    "TaskConfig",
    "config_from_dict",
    "dump_config",
    "load_config",
    "parse_value",
]
