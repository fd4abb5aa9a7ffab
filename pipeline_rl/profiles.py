"""Default profiles: the defaults that suit the model a run starts from.

The configuration's field defaults suit the built-in model (0.36 M parameters, trained
from a weak warm start: a high learning rate, 16 new tokens). A pretrained model needs
others: at 2e-4 a 135 M chat model's sampled-token entropy doubles within 3 steps. So
``--profile`` (default ``auto``) picks a set of defaults before validation:

========== ===================================================================================
builtin    the field defaults; ``auto`` picks it with no ``--model``, or a folder holding the
           built-in model (its 128-token character vocabulary)
pretrained :data:`PRETRAINED_DEFAULTS`; ``auto`` picks it for any other ``--model`` (a
           named model such as ``smollm2-135m-instruct``, a folder, a hub id)
========== ===================================================================================

A profile only fills keys the configuration does not give: a flag or a ``--config`` key
always wins. The resolved values are what ``--dry-run`` prints, and the driver's start-up
line names the profile with them (:func:`profile_line`).

Where the pretrained values come from (GRPO recipes for models of 0.1-0.5 B):

- learning rate: TRL's ``GRPOConfig`` and verl's GSM8K GRPO example (Qwen2.5-0.5B) both use
  1e-6, for runs of hundreds of steps on GPUs; a run here has to show learning within tens
  of steps on two cores, so 2e-5 (the built-in model's 2e-4 doubles a 135 M chat model's
  sampled-token entropy within 3 steps; docs/models-and-data.md has the entropy and the
  held-out curve measured at 2e-5);
- KL penalty: TRL's default ``beta`` is 0 (verl's example uses 0.001 with k3); 0 also spares
  a reference model's copy and its forward pass;
- temperature 1.0 (both recipes: sampling the policy itself keeps the off-policy ratio honest);
- length: 32 new tokens in a 512-token context. The recipes' 512-1024 new tokens are for
  GSM8K's chains of thought on GPUs; at temperature 1 a 135 M chat model rambles to any
  budget it is given, and on a CPU core (tens of tokens/s) each step's cost is that
  budget. Short answers fit in 32; a longer budget is one flag;
- LoRA learning rate (``--lora.rank`` > 0): 4e-4, twenty times the full fine-tuning rate.
  "LoRA Without Regret" (Schulman et al., Thinking Machines, 2025) finds LoRA's best learning
  rate about 10x full fine-tuning's, in supervised and in RL runs, with alpha 32 whatever the
  rank (``--lora.alpha``'s default); measured here (SmolLM2-135M-Instruct, word problems,
  rank 16, 30 steps), 10x (2e-4) trailed full fine-tuning (held-out greedy 0.41 against 0.91
  at step 30, +0.25 at best) and 20x matched it (0.84 against 0.81 in the same sitting, +0.3
  by step 20 as full fine-tuning), with the same entropy (at most 1.09x step 1's over the
  first 20 steps) (docs/models-and-data.md);
- watchdog 600 s: a real model's first step waits for the start-up evaluation, minutes on
  two busy cores, where the built-in model's waits for seconds.

Invariants: this module imports nothing heavier than the standard library; every key of a
profile names a field of :class:`pipeline_rl.config.Config` as ``section.field`` (or
``field`` at the run level).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

__all__ = ["PRETRAINED_DEFAULTS", "PRETRAINED_LORA_DEFAULTS", "PROFILE_KEYS", "ProfileName", "apply_profile", "pick_profile",
           "profile_defaults", "profile_line"]

ProfileName = Literal["builtin", "pretrained"]

#: The pretrained profile's defaults, by ``section.field`` (a run-level field by its name).
PRETRAINED_DEFAULTS: Mapping[str, float | int] = {
    "trainer.lr": 2e-5,
    "algorithm.kl_coef": 0.0,
    "rollout.temperature": 1.0,
    "rollout.max_new_tokens": 32,
    "rollout.max_model_len": 512,
    "watchdog_s": 600.0,
}

#: What the pretrained profile sets instead when the run trains a LoRA adapter (``lora.rank`` > 0).
PRETRAINED_LORA_DEFAULTS: Mapping[str, float | int] = {"trainer.lr": 4e-4}

#: What the start-up line shows, in order: (short name, ``section.field``).
PROFILE_KEYS: tuple[tuple[str, str], ...] = (
    ("lr", "trainer.lr"), ("kl", "algorithm.kl_coef"), ("temperature", "rollout.temperature"),
    ("max_new_tokens", "rollout.max_new_tokens"), ("max_model_len", "rollout.max_model_len"))

#: The built-in model's vocabulary size (pipeline_rl.models.tiny_llama.VOCAB_SIZE, kept here
#: so that reading the configuration imports no model code; a test checks they agree).
BUILTIN_VOCAB_SIZE = 128


def profile_defaults(name: ProfileName, lora: bool = False) -> Mapping[str, float | int]:
    """The defaults profile ``name`` sets (the builtin profile sets none: the field defaults are
    its own); ``lora``: for a run that trains an adapter."""
    if name != "pretrained":
        return {}
    return {**PRETRAINED_DEFAULTS, **PRETRAINED_LORA_DEFAULTS} if lora else PRETRAINED_DEFAULTS


def _trains_lora(data: Mapping[str, Any]) -> bool:
    lora = data.get("lora")
    rank = lora.get("rank", 0) if isinstance(lora, dict) else getattr(lora, "rank", 0)
    return isinstance(rank, int) and rank > 0


def pick_profile(model_path: str | None) -> ProfileName:
    """What ``--profile auto`` picks for ``--model.path`` (see the module docstring)."""
    if model_path is None or _holds_builtin_model(Path(model_path).expanduser()):
        return "builtin"
    return "pretrained"


def _holds_builtin_model(folder: Path) -> bool:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("vocab_size") == BUILTIN_VOCAB_SIZE


def apply_profile(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (the configuration's raw keys, sections as dicts or section objects) with
    ``profile`` resolved (``auto`` replaced by the picked name) and the profile's defaults
    filled in wherever ``data`` gives no value. ``data`` itself is not changed."""
    out = dict(data)
    name = out.get("profile", "auto")
    if name == "auto":
        model = out.get("model")
        path = model.get("path") if isinstance(model, dict) else getattr(model, "path", None)
        name = pick_profile(path if isinstance(path, str) else None)
    out["profile"] = name
    if name not in ("builtin", "pretrained"):
        return out   # field validation reports the bad name
    for key, value in profile_defaults(name, _trains_lora(out)).items():
        section, _, field = key.rpartition(".")
        if not section:   # a run-level field
            out.setdefault(field, value)
            continue
        given = out.get(section)
        if given is None:
            out[section] = {field: value}
        elif isinstance(given, dict):
            if field not in given:
                out[section] = {**given, field: value}
        elif hasattr(given, "model_fields_set") and field not in given.model_fields_set:
            out[section] = {**given.model_dump(exclude_unset=True), field: value}
    return out


def profile_line(profile: str, values: Mapping[str, object]) -> str:
    """The start-up line: ``profile: NAME (lr ..., kl ..., ...)`` with the values in force
    (``values`` by ``section.field``: the profile's, or a flag's where one was given)."""
    shown = (f"{short} {values[key]:g}" if isinstance(values[key], float) else f"{short} {values[key]}"
             for short, key in PROFILE_KEYS)
    return f"profile: {profile} ({', '.join(shown)})"
