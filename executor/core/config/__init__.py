"""InferenceConfig and its sections, loaded and validated from YAML."""

from executor.core.config.errors import ConfigError
from executor.core.config.inference_config import InferenceConfig, build_config, load_config
from executor.core.config.sections import DataConfig, ModelConfig, ParallelConfig, SchedulerConfig

__all__ = [
    "ConfigError",
    "DataConfig",
    "InferenceConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "build_config",
    "load_config",
]
