"""Plug-in rewards: ``--task.reward MODULE:FUNCTION`` names a Python callable
``f(prompt: str, completion: str, meta: Prompt) -> float`` (or an ``async def`` one)
that replaces a task's built-in reward; ``--task.reward http(s)://HOST:PORT/PATH`` names
a remote one (:mod:`pipeline_rl.tasks.remote_reward`, probed once here).

The spec is resolved when the task is built, which the driver does before any
process starts: a spec that is malformed, names a module that cannot be
imported, an attribute that is missing, or something that is not callable with
three positional arguments is a :class:`TaskError` of one line naming the
flag. ``FUNCTION`` may be a dotted path (``my_rewards:Scorer.score``). The
module is imported in every process that builds the task (driver and each
rollout worker), so it must be importable there (installed, or on
``PYTHONPATH``).
"""

from __future__ import annotations

import importlib
import inspect
import re

from pipeline_rl.tasks.base import RewardFn, TaskError
from pipeline_rl.tasks.remote_reward import REMOTE_SPEC, RemoteReward

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


def _takes_three_args(fn: object) -> bool:
    """False only when the signature is known and cannot bind ``(prompt, completion, meta)``."""
    try:
        inspect.signature(fn).bind(None, None, None)  # type: ignore[arg-type]
    except TypeError:
        return False
    except ValueError:  # no signature available (some builtins): accept it
        return True
    return True


def check_reward_spec(spec: str) -> None:
    """A one-line :class:`TaskError` naming ``task.reward`` unless ``spec`` is spelt
    ``MODULE:FUNCTION`` or ``http(s)://HOST:PORT/PATH``."""
    if not (REWARD_SPEC.match(spec) or REMOTE_SPEC.match(spec)):
        raise TaskError(f"task.reward: expected MODULE:FUNCTION (e.g. my_rewards:score) or "
                        f"http(s)://HOST:PORT/PATH, got {spec!r}")


def resolve_reward(spec: str, timeout_s: float = 60.0) -> RewardFn:
    """The callable ``spec`` (``MODULE:FUNCTION``) names, or the remote reward at the URL
    ``spec`` (probed once; ``timeout_s``: its per-call timeout); raises a one-line
    :class:`TaskError` naming ``task.reward`` when it cannot be resolved or reached."""
    check_reward_spec(spec)
    if REMOTE_SPEC.match(spec):
        remote = RemoteReward(spec, timeout_s)
        remote.probe()
        return remote
    obj = import_attribute(spec, "task.reward")
    if not callable(obj):
        raise TaskError(f"task.reward: '{spec}' is not callable (it is a {type(obj).__name__})")
    if not _takes_three_args(obj):
        raise TaskError(f"task.reward: '{spec}' must accept (prompt, completion, meta), "
                        f"its signature is {inspect.signature(obj)}")
    fn: RewardFn = obj  # type: ignore[assignment]
    return fn
