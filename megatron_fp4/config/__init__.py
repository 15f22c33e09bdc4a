"""Configuration: typed dataclasses, YAML files with dotted overrides, one `validate()`.

- `schema`: the dataclasses (`Config` and its sections), `load_config`, `config_from_dict`,
  `apply_overrides`, `default_config_path`
- `choices`: every allowed value of a choice field, defined once; `ConfigError`
- `validate`: `validate_config` (cross-field and layout rules, named-field errors);
  `family`: the rules of each model family
- `yaml_io`: bounded YAML parsing and value display
"""
from megatron_fp4.config.choices import ConfigError
from megatron_fp4.config.schema import (MAX_STALENESS, CheckpointConfig, Config, DataConfig, FP4Config, LoggingConfig,
                                        ModelConfig, NumericsConfig, OptimizerConfig, ParallelConfig, RLConfig,
                                        ScheduleConfig, apply_overrides, config_from_dict, default_config_path,
                                        load_config)

__all__ = ["Config", "ModelConfig", "FP4Config", "ParallelConfig", "OptimizerConfig", "ScheduleConfig", "DataConfig",
           "CheckpointConfig", "LoggingConfig", "NumericsConfig", "RLConfig", "MAX_STALENESS", "ConfigError",
           "load_config", "config_from_dict", "apply_overrides", "default_config_path"]
