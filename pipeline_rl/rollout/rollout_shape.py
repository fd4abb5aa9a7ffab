"""One rollout shape: every rollout is an async function from a prompt to a finished episode.

A single-turn completion (``rollout/single_turn.py``), an environment's episode
(``rollout/episodes.py``) and an agent's (``rollout/agents/runner.py``) are each a
:class:`Rollout`: ``await rollout(key, prompt, prompt_ids, sampling)`` is one
:class:`FinishedEpisode`. One driver (``rollout/rollout_driver.py``) runs a group's ``n``
copies, or an evaluation's sample, through whichever rollout the task names, and hands the
finished episodes on to scoring and sending (``rollout/scoring.py``), where
:func:`group_samples` turns a group's episodes into its ``Completion``\\ s.

What a rollout awaits, it awaits from the driver, on the engine loop's thread: a
:class:`Generate` (a request on the engine; its ``FinishedSequence``) or an :class:`OffLoop`
(work off the loop: an environment's call, an agent's whole call; what it hands back). The
driver steps the coroutines itself (``coroutine.send``): there is no event loop, no future
and no thread hop between the engine's step and the code that reads its result. A rollout
awaits nothing else. The messages on the hot path (:class:`Generate`, :class:`Trace`,
:class:`FinishedEpisode`) are slotted and built once per sequence; the two a rollout returns
are not frozen, for the cost of a frozen dataclass's construction, and nothing changes them
after the rollout returned them.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from pipeline_rl.rollout.engines.engine import FinishedSequence, GenRequest, SamplingConfig
from pipeline_rl.rollout.request_key import RequestKey
from pipeline_rl.rollout.worker_stats import AgentMetric
from pipeline_rl.samples import F32, I32, U8, Completion, FinishReason
from pipeline_rl.tasks.base import Prompt

#: How an episode ended, as the turn metrics count it: the environment ended it (``done``),
#: the turn cap (``turns``), the context (``length``), its environment failed (``env_error``:
#: raised, or answered with no ``EnvReply``) or did not answer in time (``timeout``).
EndKind = Literal["done", "turns", "length", "env_error", "timeout"]


@dataclass(frozen=True, slots=True)
class Generate(GenRequest):
    """``await Generate(request_id, prompt_ids, sampling)``: the engine generates this request
    (a ``GenRequest``); the result is its ``FinishedSequence`` (the driver adds the request and
    resumes the rollout with it)."""

    def __await__(self) -> Generator[Generate, Any, FinishedSequence]:
        seq: FinishedSequence = yield self
        return seq


@dataclass(frozen=True, slots=True)
class OffLoop:
    """``await OffLoop(begin)``: the driver calls ``begin(resume)`` on the loop and parks the
    rollout; ``resume(value)``, from any thread, hands ``value`` back as the result at the
    loop's next pass. Only the first ``resume`` of a wait counts; later ones are dropped."""

    begin: Callable[[Callable[[Any], None]], None]

    def __await__(self) -> Generator[OffLoop, Any, Any]:
        value = yield self
        return value


#: What a rollout awaits (and the driver's coroutines yield).
Command = Generate | OffLoop


@dataclass(slots=True, eq=False)
class Trace:
    """One sample's tokens, as the engine sampled them: ``mask`` 1 on the model's tokens (None:
    all are), whose log-probs and versions are the engine's; the rest hold placeholders."""

    token_ids: I32
    logprobs: F32
    versions: I32
    finish: FinishReason
    mask: U8 | None = None

    def completion(self, reward: float) -> Completion:
        return Completion(self.token_ids, self.logprobs, self.versions, reward, self.finish, self.mask)

    @property
    def model_versions(self) -> I32:
        return self.versions if self.mask is None else self.versions[self.mask != 0]


@dataclass(frozen=True, slots=True)
class EpisodeEnd:
    """How an episode (of an environment or an agent; a single-turn completion has none) ended,
    for the turn metrics: its end, model turns, seconds in its environment, tool calls and
    failed ones, an agent's own metrics."""

    ended: EndKind
    turns: int
    env_s: float
    tool_calls: int = 0
    tool_errors: int = 0
    metrics: tuple[AgentMetric, ...] = ()


@dataclass(slots=True, eq=False)
class FinishedEpisode:
    """What a rollout returns. ``traces``: its samples, after the group's prompt, or (``whole``)
    each with its own prompt (an agent's, cut to the group's common prompt by
    :func:`group_samples`); ``text``: the model's text, which the task's reward scores when
    ``reward`` is None (handed ``reward_ids`` as the completion's ids when given); ``end``:
    the turn metrics' record (None: a single-turn completion)."""

    key: RequestKey
    traces: tuple[Trace, ...]
    text: str
    reward: float | None = None
    reward_ids: I32 | None = None
    end: EpisodeEnd | None = None
    whole: bool = False

    @property
    def model_versions(self) -> I32:
        """The versions of the model's tokens, in order (an evaluation reads them)."""
        if len(self.traces) == 1:
            return self.traces[0].model_versions
        return np.concatenate([t.model_versions for t in self.traces]).astype(np.int32)


@runtime_checkable
class Rollout(Protocol):
    """A rollout (module docstring): ``rollout(key, prompt, prompt_ids, sampling)`` is a
    coroutine, run by the driver, whose result is the finished episode ``key`` (no turn: a
    training group's copy, or an evaluation's sample) of ``prompt``, rendered as ``prompt_ids``
    (the group's), sampled under ``sampling`` (an evaluation's, for an evaluation); it awaits
    only :data:`Command`\\ s.
    ``prompt_ids(prompt)``: the group's prompt ids when the rollout renders them itself (a
    chat episode), else None (the prompt's text, encoded). ``close()`` releases what it holds."""

    async def __call__(self, key: RequestKey, prompt: Prompt, prompt_ids: tuple[int, ...],
                       sampling: SamplingConfig) -> FinishedEpisode: ...

    def prompt_ids(self, prompt: Prompt) -> tuple[int, ...] | None: ...

    def close(self) -> None: ...


@runtime_checkable
class SideRequests(Protocol):
    """Requests a rollout adds beside its episodes' own awaits (an agent's endpoint): the
    driver calls ``pump()`` each loop pass and hands it every finished sequence whose key is
    an agent's answer; ``in_engine`` of them are queued or generating."""

    @property
    def in_engine(self) -> int: ...

    def pump(self) -> None: ...

    def collect(self, seq: FinishedSequence, key: RequestKey) -> None: ...


@dataclass(frozen=True, slots=True)
class GroupSamples:
    """A group's prompt ids and completions; ``split``: samples beyond one per episode."""

    prompt_ids: tuple[int, ...]
    completions: tuple[Completion, ...]
    split: int = 0


def group_samples(prompt_ids: tuple[int, ...], episodes: Sequence[FinishedEpisode],
                  rewards: Sequence[float]) -> GroupSamples:
    """The sample builder: a group's finished ``episodes`` (in index order) with their
    ``rewards`` as completions after ``prompt_ids``; whole samples (an agent's) after the
    longest prefix their prompts share instead, those sharing no first token with the first
    left out (a group needs one prompt), none at all when nothing is shared."""
    if not any(e.whole for e in episodes):
        return GroupSamples(prompt_ids, tuple(t.completion(r) for e, r in zip(episodes, rewards) for t in e.traces))
    pairs = [(t, r) for e, r in zip(episodes, rewards) for t in e.traces]
    split = sum(max(0, len(e.traces) - 1) for e in episodes)
    shared, completions = _shared_prompt(pairs)
    return GroupSamples(shared, completions, split)


def _first_model(t: Trace) -> int:
    if t.mask is None:
        return 0
    hits = np.flatnonzero(t.mask == 1)
    return int(hits[0]) if hits.size else int(t.mask.shape[0])


def _shared_prompt(pairs: Sequence[tuple[Trace, float]]) -> tuple[tuple[int, ...], tuple[Completion, ...]]:
    if not pairs:
        return (), ()
    head = pairs[0][0].token_ids
    kept = [(t, r) for t, r in pairs if t.token_ids.size and head.size and t.token_ids[0] == head[0]]
    limit, cut = min((_first_model(t) for t, _ in kept), default=0), 0
    while cut < limit and all(t.token_ids[cut] == head[cut] for t, _ in kept):
        cut += 1
    if cut == 0:   # an answer right at the start: no prompt at all
        return (), ()
    return tuple(head[:cut].tolist()), tuple(
        Completion(t.token_ids[cut:], t.logprobs[cut:], t.versions[cut:], r, t.finish,
                   None if t.mask is None else t.mask[cut:]) for t, r in kept)
