"""Plug-in rewards: ``--task.reward MODULE:FUNCTION`` names a Python callable (``def`` or
``async def``) that replaces a task's built-in reward, of our form ``f(prompt, completion,
meta) -> float``, TRL's or verl's (:mod:`pipeline_rl.tasks.reward_forms`);
``--task.reward http(s)://HOST:PORT/PATH`` names a remote one
(:mod:`pipeline_rl.tasks.remote_reward`, probed once here); several, comma-separated with
``@WEIGHT``s, are summed (:mod:`pipeline_rl.tasks.reward_mix`).

The spec is resolved when the task is built, which the driver does before any
process starts: a spec that is malformed, names a module that cannot be
imported, an attribute that is missing, or something that is not callable in
one of the forms is a :class:`TaskError` of one line naming the flag. ``FUNCTION``
may be a dotted path (``my_rewards:Scorer.score``). The module is imported in every
process that builds the task (driver and each rollout worker), so it must be importable
there (installed, or on ``PYTHONPATH``).
"""

from __future__ import annotations

import importlib
import re
from typing import Literal

from pipeline_rl.tasks.base import TaskError
from pipeline_rl.tasks.remote_reward import REMOTE_SPEC, RemoteReward
from pipeline_rl.tasks.reward_forms import Form, PluginReward, wrap
from pipeline_rl.tasks.reward_mix import Reward, WeightedReward, split_specs

#: ``dotted.module:dotted.attribute``, identifiers only.
REWARD_SPEC = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def import_attribute(spec: str, flag: str) -> object:
    """What ``MODULE:ATTR.PATH`` names; a one-line :class:`TaskError` naming ``flag`` when
    the module cannot be imported or has no such attribute."""
    module, _, attr_path = spec.partition(":")
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise TaskError(f"{flag}: cannot import module '{module}' ({_first_line(e)}; "
                        f"is it installed or on PYTHONPATH?)") from None
    except Exception as e:  # user code failing at import: report it, never crash with a traceback
        raise TaskError(f"{flag}: importing module '{module}' failed: {_first_line(e)}") from None
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise TaskError(f"{flag}: module '{module}' has no attribute '{attr_path}'")
        obj = getattr(obj, part)
    return obj


def check_reward_spec(spec: str) -> None:
    """A one-line :class:`TaskError` naming ``task.reward`` unless every comma-separated part
    of ``spec`` is spelt ``MODULE:FUNCTION`` or ``http(s)://HOST:PORT/PATH`` (with an
    optional ``@WEIGHT``)."""
    for part in split_specs(spec):
        if not (REWARD_SPEC.match(part.spec) or REMOTE_SPEC.match(part.spec)):
            raise TaskError(f"task.reward: expected MODULE:FUNCTION (e.g. my_rewards:score) or "
                            f"http(s)://HOST:PORT/PATH, got {part.spec!r}")


def _resolve_one(spec: str, timeout_s: float, form: Form | Literal["auto"], data_source: str) -> PluginReward:
    if REMOTE_SPEC.match(spec):
        remote = RemoteReward(spec, timeout_s)
        remote.probe()
        return wrap(remote, spec, "remote")
    obj = import_attribute(spec, "task.reward")
    if not callable(obj):
        raise TaskError(f"task.reward: '{spec}' is not callable (it is a {type(obj).__name__})")
    return wrap(obj, spec, form, data_source)


def resolve_reward(spec: str, timeout_s: float = 60.0, form: Form | Literal["auto"] = "auto",
                   data_source: str = "pipeline_rl") -> Reward:
    """The reward ``spec`` names: each part a callable (``MODULE:FUNCTION``, of the form its
    signature shows, or ``form``) or the remote reward at a URL (probed once; ``timeout_s``:
    its per-call timeout), several parts weighted (:mod:`pipeline_rl.tasks.reward_mix`);
    ``data_source``: verl's ``data_source`` where the data has none. Raises a one-line
    :class:`TaskError` naming ``task.reward`` when a part cannot be resolved, reached, or
    matches no reward form."""
    check_reward_spec(spec)
    parts = split_specs(spec)
    resolved = [(_resolve_one(p.spec, timeout_s, form, data_source), p.weight) for p in parts]
    if len(resolved) == 1 and resolved[0][1] == 1.0:
        return resolved[0][0]
    return WeightedReward(spec, tuple(resolved))
