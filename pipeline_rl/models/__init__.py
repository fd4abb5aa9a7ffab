"""Model builders: the built-in small causal LM, its character tokenizer, and its warm start.

Importing this package imports no torch; :func:`default_model_dir` does, when called.
"""

from pipeline_rl.models.tiny_llama import build_tiny_model
from pipeline_rl.models.default import cache_root, default_model_dir
from pipeline_rl.models.probes import Probe
from pipeline_rl.models.warmstart_recipe import WarmStartRecipe, recipe_for

__all__ = ["Probe", "WarmStartRecipe", "build_tiny_model", "cache_root", "default_model_dir", "recipe_for"]
