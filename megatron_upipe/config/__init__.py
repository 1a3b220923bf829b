"""The typed configuration tree of pretrain_llama.py (no torch or megatron-core imports).

  schema    one frozen dataclass per section (model, parallel, train, data, checkpoint, log, dist, memory)
  loader    defaults < YAML file < section.key=value overrides, with type checks and did-you-mean errors
  validate  the cross-section checks against the world size, and the derived Plan; the files the config reads
  outputs   the places the run writes (checkpoint.dir, log.*, the data cache): writable, probed at start-up
  machine   what this machine must have for the config (CUDA, optional packages), checked at the real start
"""

from .fieldtypes import ConfigError
from .loader import load_config, to_yaml
from .machine import machine_problems
from .outputs import check_outputs
from .schema import Config
from .validate import Plan, check_paths, validate

__all__ = ["Config", "ConfigError", "Plan", "check_outputs", "check_paths", "load_config", "machine_problems", "to_yaml",
           "validate"]
