"""L0: typed, validated configuration dataclasses (errors name the field and what is allowed).

A run is one `RunConfig`, read from YAML with dotted overrides by `load_config`.
"""

from entr_megatron.config.algorithm import AlgorithmConfig
from entr_megatron.config.controller import ControllerConfig
from entr_megatron.config.launcher import LauncherConfig, LoggingConfig, WandbConfig
from entr_megatron.config.learner import LearnerConfig, OptimConfig
from entr_megatron.config.loader import config_from_dict, dump_config, load_config, parse_value
from entr_megatron.config.model import ModelConfig, ParallelConfig
from entr_megatron.config.rollout import AgentConfig, EmbeddedConfig, RolloutConfig, SamplingConfig, SGLangConfig
from entr_megatron.config.run import RunConfig
from entr_megatron.config.task import (
    ArithmeticTaskConfig, CalculatorTaskConfig, MathTaskConfig, SearchTaskConfig, SFTConfig, TaskConfig,
)

__all__ = [
    "AgentConfig",
    "AlgorithmConfig",
    "ArithmeticTaskConfig",
    "CalculatorTaskConfig",
    "ControllerConfig",
    "EmbeddedConfig",
    "LauncherConfig",
    "LearnerConfig",
    "LoggingConfig",
    "WandbConfig",
    "MathTaskConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SearchTaskConfig",
    "SGLangConfig",
    "SamplingConfig",
    "TaskConfig",
    "config_from_dict",
    "dump_config",
    "load_config",
    "parse_value",
]
