"""The built-in default model folder: built, warm-started and cached locally (nothing downloaded).

:func:`default_model_dir` returns a Hugging Face folder that loads in transformers
and vLLM. The first call builds it (random init, then the supervised warm start
of :mod:`pipeline_rl.models.warmstart`, tens of seconds on one CPU core) into a
cache folder; later calls with the same model shape, task and recipe return the
cached folder at once. The folder name carries a hash of everything that
determines the weights, so a changed recipe never reuses stale weights.

Cache root, first that applies: ``$PIPELINE_RL_CACHE_DIR``; ``.cache/pipeline_rl``
in the source checkout (git-ignored); ``~/.cache/pipeline_rl``. A build goes into
a temporary sibling folder and is renamed into place when complete, so a crash
or a concurrent build never leaves a half-written model behind.

The console during a build: one progress line (:class:`pipeline_rl.console.Progress`:
steps, rate, time left, what runs now), then one line saying what was built; everything
else printed meanwhile (third-party warnings, library bars) goes to the build's log,
``<cache root>/<folder name>.log``.
"""

from __future__ import annotations

import logging
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline_rl.console import Progress, quiet_console
from pipeline_rl.models.tiny_llama import VOCAB_SIZE, build_tiny_model
from pipeline_rl.models.probes import probe, sampled_reward
from pipeline_rl.models.warmstart import warm_start
from pipeline_rl.models.warmstart_recipe import WarmStartRecipe, recipe_for

log = logging.getLogger("pipeline_rl.models")

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from pipeline_rl.config import ModelConfig, TaskConfig
    from pipeline_rl.tasks.base import Task

#: File written next to the weights: the recipe and the probe of the warm-started model.
INFO_FILE = "warmstart.json"


def cache_root() -> Path:
    """Where built models are cached (see the module doc for the order)."""
    env = os.environ.get("PIPELINE_RL_CACHE_DIR")
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and os.access(checkout, os.W_OK):
        return checkout / ".cache" / "pipeline_rl"
    return Path.home() / ".cache" / "pipeline_rl"


def _key(cfg: "ModelConfig", task_name: str, digits: int, recipe: WarmStartRecipe | None) -> str:
    recipe_spec = asdict(recipe) if recipe is not None else None
    if recipe_spec is not None and recipe_spec["micro_batches"] == 1:
        del recipe_spec["micro_batches"]   # same weights, same key as before the field existed
    if recipe_spec is not None and recipe is not None and not recipe.closed_loop:   # open loop: its old key
        for name in ("stop_reward", "chunk", "max_chunks", "probe_prompts", "probe_tokens"):
            del recipe_spec[name]
    spec = {"hidden": cfg.hidden_size, "layers": cfg.num_layers, "heads": cfg.num_heads,
            "mlp": cfg.intermediate_size, "vocab": VOCAB_SIZE, "task": task_name, "digits": digits,
            "recipe": recipe_spec}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def default_model_dir(cfg: "ModelConfig", task: "TaskConfig | None" = None, *,
                      recipe: WarmStartRecipe | None = None, cache_dir: Path | None = None,
                      seed: int = 0) -> Path:
    """A ready Hugging Face folder for the built-in model, warm-started on ``task``.

    ``task`` defaults to ``TaskConfig()``; for a built-in task (``addition``,
    ``sort``, ``countdown``, ``calc``) the model is warm-started with ``recipe`` (default:
    :func:`~pipeline_rl.models.warmstart_recipe.recipe_for` the task); for ``dataset``
    it is left at its random initialisation. Raises ValueError when
    ``cfg.path`` is set (that model is the user's, not built here).
    """
    from pipeline_rl.config import TaskConfig

    if cfg.path is not None:
        raise ValueError(f"model.path is set ({cfg.path}); default_model_dir builds only the built-in model")
    task_cfg = task if task is not None else TaskConfig()
    label: str
    if task_cfg.name in ("addition", "sort", "countdown", "calc"):
        recipe = recipe if recipe is not None else recipe_for(task_cfg.name, task_cfg.digits, seed=seed)
        label, digits = task_cfg.name, task_cfg.digits
    else:  # a dataset: nothing to warm-start on, the built-in model stays at its random init
        recipe, label, digits = None, "init", 0
    name = f"builtin-{label}{digits or ''}-{_key(cfg, label, digits, recipe)}"
    root = cache_dir if cache_dir is not None else cache_root()
    final = root / name
    if (final / INFO_FILE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("building the built-in model %s (first run only; cached in %s)", name, root)
    build_log = root / f"{name}.log"
    try:
        try:
            with quiet_console(build_log) as console, Progress(f"warm start ({label})", _planned_steps(recipe),
                                                               note="loading torch", stream=console) as bar:
                warning = _build(cfg, task_cfg, recipe, tmp, seed, bar)
        except Exception:
            log.error("building %s failed; what it printed is in %s", name, build_log)
            raise
        log.info("built in %.0f s: %s (its output: %s)", bar.close(), name, build_log)
        if warning:
            log.warning("warm start %s: %s", name, warning)
        try:
            tmp.rename(final)
        except OSError:  # another process finished the same build first: theirs is identical
            if not (final / INFO_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _planned_steps(recipe: WarmStartRecipe | None) -> int:
    """The progress line's first total: the recipe's steps, to the first check when closed-loop
    (the line's total grows by a chunk at each check that does not stop it); 1 for a bare init."""
    if recipe is None:
        return 1
    return recipe.steps + (recipe.chunk if recipe.closed_loop and recipe.max_chunks > 0 else 0)


def _build(cfg: "ModelConfig", task_cfg: "TaskConfig", recipe: WarmStartRecipe | None,
           out: Path, seed: int, bar: Progress) -> str | None:
    """Random init into ``out``, then (with a recipe) warm start and probe; writes :data:`INFO_FILE` last.
    Returns a warning for the console (a closed-loop warm start that never reached its reward), if any."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # library bars would only clutter the build's log

    bar.note("random init")
    build_tiny_model(out, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                     intermediate_size=cfg.intermediate_size, seed=seed)
    info: dict[str, object] = {"task": task_cfg.name, "digits": task_cfg.digits, "recipe": None}
    warning = None
    if recipe is None:
        bar.update()
    else:
        t0 = time.perf_counter()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)   # the same weights whatever the caller's thread settings
        try:
            warning = _warm_start_into(out, task_cfg, recipe, info, bar)
        finally:
            torch.set_num_threads(threads)
        info["build_s"] = round(time.perf_counter() - t0, 1)
    (out / INFO_FILE).write_text(json.dumps(info, indent=2))
    return warning


def _warm_start_into(out: Path, task_cfg: "TaskConfig", recipe: WarmStartRecipe, info: dict[str, object],
                     bar: Progress) -> str | None:
    """Warm-start the model saved in ``out`` in place; record the recipe and probe in ``info``;
    returns a warning when a closed-loop recipe's checks never reached its reward."""
    import torch
    from transformers import LlamaForCausalLM

    from pipeline_rl.models.hf_episodes import probe_episodes
    from pipeline_rl.tasks.base import TaskError
    from pipeline_rl.tasks.build import build_task
    from pipeline_rl.tasks.env import task_env_factory
    from pipeline_rl.tasks.builtin import countdown_answer_tokens

    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    task = build_task(task_cfg, seed=0)
    checks: list[tuple[int, float]] = []
    bar.note("training")
    losses = warm_start(model, task, recipe, checks=checks, progress=bar, check=_shown_check(task, recipe, bar))
    budget = countdown_answer_tokens(task_cfg.digits) if task_cfg.name == "countdown" else 16
    episodes = task_env_factory(task) is not None
    measure = probe_episodes if episodes else probe   # multi-turn: episodes
    turns = int((probe_episodes.__kwdefaults__ or {}).get("max_turns", 1)) if episodes else 1
    bar.phase(f"probe ({task_cfg.name})", 2 * turns * (budget + 1), unit="token", note="held-out prompts")
    with _counting_forwards(model, bar):
        try:   # measured on held-out prompts (a 1-digit task may have none)
            result = measure(model, build_task(task_cfg, seed=0, split="eval"), max_new_tokens=budget)
        except TaskError:
            result = measure(model, task, max_new_tokens=budget)
    bar.note("saving")
    model.save_pretrained(out)
    info.update(recipe=asdict(recipe), steps=len(losses), checks=checks,
                final_loss=sum(losses[-20:]) / min(20, len(losses)), probe=asdict(result))
    if recipe.closed_loop and not (checks and checks[-1][1] >= recipe.stop_reward):
        return f"no check reached sampled reward {recipe.stop_reward:.2f} in {recipe.max_chunks} chunks ({checks})"
    return None


def _shown_check(task: "Task", recipe: WarmStartRecipe, bar: Progress) -> "Callable[[PreTrainedModel], float]":
    """The closed loop's check (:func:`~pipeline_rl.models.probes.sampled_reward`) on the
    progress line: its tokens counted while it samples, its score noted after."""
    done = 0

    def check(model: "PreTrainedModel") -> float:
        nonlocal done
        done += 1
        training = bar.phase(f"check {done} ({task.name})", recipe.probe_tokens + 1, unit="token",
                             note=f"sampled reward >= {recipe.stop_reward:.3f} stops")
        with _counting_forwards(model, bar):
            score = sampled_reward(model, task, recipe)
        bar.resume(training, note=f"check {done}: reward {score:.3f} (stop at {recipe.stop_reward:.3f})")
        return score

    return check


@contextmanager
def _counting_forwards(model: "PreTrainedModel", bar: Progress) -> Iterator[None]:
    """Count each forward pass of ``model`` on ``bar`` (a sampling loop makes one per token)."""
    handle = model.register_forward_hook(lambda *_: bar.update())
    try:
        yield
    finally:
        handle.remove()
