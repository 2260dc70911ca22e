"""Run configuration: typed dataclasses, YAML files in conf/, `key=value` overrides.

`load_config("conf/quickstart.yaml", ["algo.eta=4"])` merges, in order, the dataclass
defaults, the YAML file and the overrides. Unknown keys, ill-typed values and choices
not on the list are errors that name the key, before any work starts. Every field
carries a one-line help text: `python -m jobs.train --help` prints them all with their
defaults.

One module per component holds its section (`model`, `task`, `rollout`, `reward`,
`algo`, `train`, `weights`, `run`, `eval`, `sft`) with the checks of its own fields; `root`
holds `Config` and the checks across sections; `choices` the enums of the named choices;
`load` reading, `to_dict` and `--help`. This package imports no torch: the config is
unpickled in processes that never touch a tensor (tests/test_light_imports.py).
"""

from areal_ray.config.algo import (
    AdvantageConfig,
    AlgoConfig,
    CriticConfig,
    DynamicFilterConfig,
    LossConfig,
    MicrobatchConfig,
    OptimConfig,
    RewardShapingConfig,
)
from areal_ray.config.choices import (
    AdvEstimator,
    AdvNorm,
    Batching,
    Choice,
    CollectiveBackend,
    ImportanceLevel,
    KlEstimator,
    LoraPush,
    LrSchedule,
    MasterDtype,
    ProxLogp,
    RolloutBackend,
    Router,
    WeightPath,
)
from areal_ray.config.eval import EvalConfig
from areal_ray.config.load import help_lines, load_config, to_dict, validate
from areal_ray.config.model import LoraConfig, ModelConfig
from areal_ray.config.reward import RewardConfig
from areal_ray.config.rollout import RolloutConfig
from areal_ray.config.root import Config
from areal_ray.config.run import RunConfig
from areal_ray.config.section import ConfigError, opt
from areal_ray.config.sft import SftConfig
from areal_ray.config.task import TaskConfig
from areal_ray.config.train import TrainConfig
from areal_ray.config.weights import WeightsConfig

__all__ = [
    "AdvEstimator", "AdvNorm", "AdvantageConfig", "AlgoConfig", "Batching", "Choice",
    "CollectiveBackend", "Config", "ConfigError", "CriticConfig", "DynamicFilterConfig",
    "EvalConfig", "ImportanceLevel", "KlEstimator", "LossConfig", "LrSchedule", "MasterDtype",
    "LoraConfig", "LoraPush", "MicrobatchConfig", "ModelConfig", "OptimConfig", "ProxLogp", "RewardConfig",
    "RewardShapingConfig", "RolloutBackend", "RolloutConfig", "Router", "RunConfig", "SftConfig",
    "TaskConfig", "TrainConfig", "WeightPath", "WeightsConfig", "help_lines", "load_config",
    "opt", "to_dict", "validate",
]
