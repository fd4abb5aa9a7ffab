"""Reward functions in the forms people already have, behind one batch interface.

``--task.reward MODULE:FUNCTION`` may name a function of any of three forms, told apart
by its signature (or set with ``--task.reward_form``):

- **ours**: ``f(prompt, completion, meta) -> float`` (``meta``: the
  :class:`~pipeline_rl.tasks.base.Prompt`), one completion per call;
- **TRL** (``GRPOTrainer``'s ``reward_funcs``): ``f(prompts, completions, **kwargs) ->
  list[float | None]``: recognised by a parameter named ``completions``. Called with
  keywords, a batch (a group's completions) at a time: ``prompts`` (the prompt as
  written, once per completion), ``completions`` (the texts), or, where the prompt went
  through the chat template, both in TRL's conversational form (``[{"role": "user",
  "content": prompt}]`` and ``[{"role": "assistant", "content": text}]``, as TRL gives a
  dataset of messages, so ``completion[0]["content"]`` works), the data's columns as
  lists (every column of a dataset but ``prompt``; ``answer``, the reference answer,
  always), and ``completion_ids`` (the generated token ids) when the function names
  it. A ``None`` in the result is "no score" (TRL's convention): scored 0 and counted
  apart from failures;
- **verl**: ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``:
  recognised by parameters named ``solution_str`` and ``ground_truth``; called with
  keywords, one completion per call: ``data_source`` (the data's ``data_source``
  column, else the task's name), ``ground_truth`` (the reference answer), ``extra_info``
  (the data's ``extra_info`` column when it is a dict, else ``{"index", "question",
  "answer"}``). A dict result gives its ``score``.

Every form is wrapped in a :class:`PluginReward`, whose :meth:`PluginReward.score_batch`
is the one interface the rollout worker calls; ``__call__`` is the per-completion form
(``Task.reward``). Nothing here imports anything beyond the standard library.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Literal

from pipeline_rl.tasks.base import BatchReward, Prompt, TaskError

#: How a reward function is called (``auto``: told by its signature).
Form = Literal["ours", "trl", "verl", "remote"]
#: What a batch call returns: one value per completion (``None``: no score), or an awaitable of it.
Scores = list[object]
#: The forms accepted, as one error line names them.
FORMS_LINE = ("ours f(prompt, completion, meta) -> float, TRL's f(prompts, completions, **kwargs) -> "
              "list[float] or verl's compute_score(data_source, solution_str, ground_truth, extra_info=None)")
#: Keyword arguments a TRL function gets that are not data columns.
TRL_ARGS = frozenset({"prompts", "completions", "completion_ids"})


def _params(fn: object) -> Mapping[str, inspect.Parameter] | None:
    try:
        return inspect.signature(fn).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):  # no signature available (some builtins)
        return None


def _takes_three_args(fn: object) -> bool:
    """False only when the signature is known and cannot bind ``(prompt, completion, meta)``."""
    try:
        inspect.signature(fn).bind(None, None, None)  # type: ignore[arg-type]
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def detect_form(fn: object) -> Form | None:
    """The form ``fn``'s signature shows (module docstring), or None when it fits none."""
    if isinstance(fn, BatchReward):
        return "remote"
    params = _params(fn)
    if params is not None and "solution_str" in params and "ground_truth" in params:
        return "verl"
    if params is not None and "completions" in params:
        return "trl"
    return "ours" if _takes_three_args(fn) else None


def _is_async(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _has_var_keyword(params: Mapping[str, inspect.Parameter] | None) -> bool:
    return params is None or any(p.kind is p.VAR_KEYWORD for p in params.values())


def prompt_columns(meta: Prompt) -> dict[str, object]:
    """The data's columns for ``meta``: its dataset row's (when kept), with ``prompt`` (as
    written) and ``answer`` (the reference answer) always there."""
    return {"prompt": meta.question, "answer": meta.answer, **meta.columns}


@dataclass(frozen=True)
class PluginReward:
    """One reward function ``fn`` of form ``form``, called as its form wants.

    ``name``: how messages name it (the spec). ``per_completion``: one completion per call
    (ours, verl), else a batch (TRL, remote). ``is_async``: ``fn`` is ``async def`` (the
    worker runs it on its event loop, else on its thread pool). ``columns``: the data
    columns ``fn`` asks for by name and must get (checked against the data by
    :meth:`check_columns` before anything starts). ``wants_columns``: the data's rows must
    keep their other columns (TRL and verl forms). ``data_source``: verl's ``data_source``
    when the data has no such column."""

    name: str
    fn: Callable[..., Any]
    form: Form
    data_source: str = "pipeline_rl"

    @functools.cached_property
    def params(self) -> Mapping[str, inspect.Parameter] | None:
        """``fn``'s parameters (None: no signature available), read once."""
        return _params(self.fn)

    @property
    def per_completion(self) -> bool:
        return self.form in ("ours", "verl")

    @property
    def is_async(self) -> bool:
        return _is_async(self.fn)

    @property
    def wants_columns(self) -> bool:
        return self.form in ("trl", "verl")

    @property
    def wants_ids(self) -> bool:
        return self.form == "trl" and self.params is not None and "completion_ids" in self.params

    @property
    def columns(self) -> frozenset[str]:
        """Required (no default) named parameters of a TRL function that are data columns."""
        params = self.params
        if self.form != "trl" or params is None:
            return frozenset()
        return frozenset(n for n, p in params.items() if n not in TRL_ARGS and p.default is p.empty
                         and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))

    def check_columns(self, available: frozenset[str], where: str) -> None:
        """A one-line :class:`TaskError` naming ``task.reward`` and the first column ``fn``
        asks for that ``available`` (the columns of ``where``: the data) lacks."""
        missing = sorted(self.columns - available - {"answer"})
        if missing:
            raise TaskError(f"task.reward: {self.name} asks for the column '{missing[0]}', which {where} "
                            f"does not have (columns: {', '.join(sorted(available | {'answer'}))})")

    def score_batch(self, meta: Prompt, completions: Sequence[str],
                    completion_ids: Sequence[Iterable[int]] | None = None) -> Scores | Awaitable[Scores]:
        """One value per completion of ``meta`` (``None``: no score), in order; an awaitable
        of them when ``fn`` is ``async def``. Values are checked by the caller."""
        if self.form == "remote":
            remote: BatchReward = self.fn  # type: ignore[assignment]
            return remote.score_batch(meta, completions)
        if self.form == "trl":
            return self._trl(meta, completions, completion_ids)
        calls = [self._one(meta, c) for c in completions]
        if self.is_async:
            return self._gathered(calls)
        return [self._value(v) for v in calls]

    def __call__(self, prompt: str, completion: str, meta: Prompt) -> float:
        """The per-completion form (``Task.reward``): the batch of one, run to its end;
        no score is 0."""
        out = self.score_batch(meta, [completion])
        values = asyncio.run(_awaited(out)) if inspect.isawaitable(out) else out
        value = values[0]
        return 0.0 if value is None else float(value)  # type: ignore[arg-type]

    def _one(self, meta: Prompt, completion: str) -> object:
        if self.form == "ours":
            return self.fn(meta.text, completion, meta)
        cols = prompt_columns(meta)
        extra = cols.get("extra_info")
        kwargs: dict[str, object] = {
            "data_source": cols.get("data_source", self.data_source), "solution_str": completion,
            "ground_truth": meta.answer,
            "extra_info": extra if isinstance(extra, dict) else {"index": meta.prompt_id, "question": meta.question,
                                                                 "answer": meta.answer}}
        params = self.params
        if not _has_var_keyword(params) and params is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return self.fn(**kwargs)

    async def _gathered(self, calls: list[Any]) -> Scores:
        return [self._value(v) for v in await asyncio.gather(*calls)]

    def _value(self, value: object) -> object:
        """A verl dict's ``score``; ours and verl never return no score (None is an error)."""
        if isinstance(value, dict):
            if "score" not in value:
                raise TypeError(f"returned a dict without a 'score' key ({', '.join(map(str, value))})")
            value = value["score"]
        if value is None:
            raise TypeError("returned None, not a number")
        return value

    def _trl(self, meta: Prompt, completions: Sequence[str],
             completion_ids: Sequence[Iterable[int]] | None) -> Scores | Awaitable[Scores]:
        n = len(completions)
        params = self.params
        cols = {k: v for k, v in prompt_columns(meta).items() if k not in TRL_ARGS and k != "prompt"}
        prompts: list[Any] = [meta.question] * n
        texts: list[Any] = list(completions)
        if meta.templated:   # TRL's conversational form
            prompts = [[{"role": "user", "content": meta.question}] for _ in range(n)]
            texts = [[{"role": "assistant", "content": c}] for c in completions]
        kwargs: dict[str, object] = {"prompts": prompts, "completions": texts, **{k: [v] * n for k, v in cols.items()}}
        if self.wants_ids:
            kwargs["completion_ids"] = [list(map(int, ids)) for ids in completion_ids] if completion_ids else None
        if not _has_var_keyword(params) and params is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        out = self.fn(**kwargs)
        return _listed(out) if inspect.isawaitable(out) else _as_list(out)


def _as_list(out: object) -> Scores:
    """A batch reward's result as a list; a ``TypeError`` when it is not a sequence."""
    if isinstance(out, (str, bytes)) or not hasattr(out, "__iter__"):
        raise TypeError(f"returned {type(out).__name__} {out!r:.40}, not a list of scores")
    return list(out)  # type: ignore[call-overload]


async def _awaited(out: Awaitable[Scores]) -> Scores:
    return await out


async def _listed(out: Awaitable[Any]) -> Scores:
    return _as_list(await out)


def wrap(fn: Callable[..., Any], name: str, form: Form | Literal["auto"] = "auto",
         data_source: str = "pipeline_rl") -> PluginReward:
    """``fn`` as a :class:`PluginReward` of the given (or detected) form; a one-line
    :class:`TaskError` naming ``task.reward`` and the accepted forms when it fits none."""
    found = detect_form(fn) if form == "auto" else form
    if found is None or (found == "ours" and not _takes_three_args(fn)):
        try:
            sig = str(inspect.signature(fn))
        except (TypeError, ValueError):
            sig = "unknown"
        raise TaskError(f"task.reward: {name} matches none of the reward forms (its signature is {sig}); "
                        f"accepted: {FORMS_LINE}")
    return PluginReward(name, fn, found, data_source)


def finite_or_none(value: object) -> float | None:
    """``value`` as a finite float (None stays None); a ``TypeError`` / ``ValueError`` otherwise."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"returned {type(value).__name__} {value!r:.40}, not a number")
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number):
        raise ValueError(f"returned {number}, not a finite number")
    return number
