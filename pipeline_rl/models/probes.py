"""How a model does, measured by sampling it: :func:`probe` on held-out prompts (the end of
the task's pool: sampled and greedy reward, how often it stops) and :func:`sampled_reward`,
the warm start's closed-loop check on the training prompts RL starts on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline_rl.models.hf_sampling import sample
from pipeline_rl.tasks.base import Prompt, Task

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from pipeline_rl.models.warmstart_recipe import WarmStartRecipe


@dataclass(frozen=True)
class Probe:
    """How a model does on held-out prompts: mean reward sampled at temperature 1, greedy
    accuracy, and the fraction of samples that ended with ``<eos>``."""

    sampled_reward: float
    greedy_reward: float
    stop_frac: float
    examples: tuple[str, ...]


def last_prompts(task: Task, k: int) -> list[Prompt]:
    """The ``k`` prompts at the end of ``task``'s pool (ids ``num_prompts - k`` on), where probes look."""
    start = max(0, task.num_prompts - k)
    return [task.prompt(start + i) for i in range(k)]


def probe(model: "PreTrainedModel", task: Task, *, num_prompts: int = 256, max_new_tokens: int = 16,
          seed: int = 0) -> Probe:
    """Measure ``model`` on prompts from the end of the task's pool (ids ``num_prompts - k``...)."""
    import torch

    prompts = last_prompts(task, num_prompts)
    g = torch.Generator().manual_seed(seed)
    hot = sample(model, task, prompts, n=1, max_new_tokens=max_new_tokens, temperature=1.0, generator=g)
    cold = sample(model, task, prompts, n=1, max_new_tokens=max_new_tokens, temperature=1e-5, generator=g)
    return Probe(float(hot.rewards.mean()), float(cold.rewards.mean()), float(hot.stopped.float().mean()),
                 tuple(f"{p.text}{t}" for p, t in zip(prompts[:4], hot.texts[:4])))


def sampled_reward(model: "PreTrainedModel", task: Task, recipe: WarmStartRecipe) -> float:
    """The closed loop's check: mean reward of one sample (temperature 1, ``recipe.probe_tokens``
    at most) on each of ``recipe.probe_prompts`` training prompts, the last ids of the pool --
    the prompts RL starts on."""
    import torch

    got = sample(model, task, last_prompts(task, min(recipe.probe_prompts, task.num_prompts)), n=1, max_new_tokens=recipe.probe_tokens, temperature=1.0,
                 generator=torch.Generator().manual_seed(recipe.seed))
    return float(got.rewards.mean())
