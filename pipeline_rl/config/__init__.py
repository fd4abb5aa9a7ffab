"""The configuration, one folder: ``from pipeline_rl.config import Config`` (or any section).

:class:`Config` is the tree (``tree.py``: its checks across sections and the small sections
buffer, run, ray, eval); each larger section is a ``*_config.py`` module of its own here, on the
base in ``pipeline_rl/config_section.py`` (``--task.*`` is ``tasks/task_config.py``, the task's
own section); ``config_renames.py`` turns an old key into one line naming the
new. This face re-exports the tree and every section's names: one import for the whole tree.
Nothing here imports torch, vLLM or Ray, so ``--help`` is instant; the modules of this folder
import no module of the package above them (only ``profiles``, the weight-path table and,
from ``tasks/``, the task's section and a countdown answer's length).
"""

from pipeline_rl.config.algorithm_config import AdvantageName as AdvantageName, AlgorithmConfig as AlgorithmConfig
from pipeline_rl.config.algorithm_config import KLEstimator as KLEstimator, LossName as LossName, NormName as NormName
from pipeline_rl.config.algorithm_config import RatioReference as RatioReference
from pipeline_rl.config_section import Section as Section
from pipeline_rl.config.correction_config import Correction as Correction, CorrectionConfig as CorrectionConfig
from pipeline_rl.config.correction_config import CorrectionName as CorrectionName
from pipeline_rl.config.correction_config import CustomCorrection as CustomCorrection, PresetCorrection as PresetCorrection
from pipeline_rl.config.lora_config import LoraConfig as LoraConfig
from pipeline_rl.config.model_config import CPU_SUPPORTED_HEAD_DIMS as CPU_SUPPORTED_HEAD_DIMS, ModelConfig as ModelConfig
from pipeline_rl.config.model_config import Device as Device, DType as DType
from pipeline_rl.config.optimizer_config import AdamWConfig as AdamWConfig, MuonConfig as MuonConfig
from pipeline_rl.config.rollout_config import KVPolicy as KVPolicy, RolloutConfig as RolloutConfig
from pipeline_rl.tasks.task_config import TaskConfig as TaskConfig
from pipeline_rl.config.trainer_config import LRScheduleName as LRScheduleName, TrainerConfig as TrainerConfig
from pipeline_rl.config.tree import BufferConfig as BufferConfig, Config as Config, EvalConfig as EvalConfig
from pipeline_rl.config.tree import RayConfig as RayConfig, RunConfig as RunConfig
