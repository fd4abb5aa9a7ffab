"""What a rollout request is, typed: the one place its engine request id is written and read.

Ids (the vLLM request ids, and an episode's name to the agents' endpoint and process)::

    GROUP:INDEX                        a training group's completion INDEX
    eval:EVAL:PROMPT:SAMPLE            an evaluation's SAMPLE (0: the greedy one) of its PROMPT
    ...#TURN                           an episode's turn TURN (either of the above is the episode)
    ...#aREQUEST.ANSWER                an agent episode's request REQUEST, its answer ANSWER

The worker, the episode driver and the agents' runner build and read keys only through
:class:`RequestKey`: ``to_id`` when a request goes into the engine, :meth:`RequestKey.parse`
when a finished sequence comes out of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

#: Request ids of evaluation sequences start with this (training ids are ``GROUP:INDEX``).
EVAL_PREFIX = "eval:"

_ID = re.compile(rf"(?:{re.escape(EVAL_PREFIX)}(\d+):(\d+):(\d+)|(\d+):(\d+))(?:#(?:(\d+)|a(\d+)\.(\d+)))?", re.ASCII)


@dataclass(frozen=True, slots=True)
class RequestKey:
    """One request (or, with no ``turn``, one episode). ``group``: the training group's id,
    or the evaluation's id; ``index``: the completion's index in its group, or the
    evaluation's sample (0 greedy); ``prompt``: the evaluation's prompt index (None: a
    training request); ``turn``: the episode's turn, or the agent's request number;
    ``answer``: that agent request's answer. Invariants: every field is a non-negative int or
    None, ``answer`` only with ``turn``, and ``RequestKey.parse(k.to_id()) == k``."""

    group: int
    index: int
    prompt: int | None = None
    turn: int | None = None
    answer: int | None = None

    def __post_init__(self) -> None:
        if (type(self.group) is int and type(self.index) is int and self.group >= 0 and self.index >= 0
                and self.prompt is None and self.turn is None and self.answer is None):
            return   # a training completion's key (the most made): the checks below, at less cost
        for name in ("group", "index", "prompt", "turn", "answer"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"RequestKey.{name} must be a non-negative int (got {v!r})")
        if self.answer is not None and self.turn is None:
            raise ValueError(f"RequestKey: answer {self.answer} needs the agent request's number (turn)")

    @classmethod
    def of_eval(cls, eval_id: int, prompt: int, sample: int) -> RequestKey:
        """Sample ``sample`` (0: greedy) of evaluation ``eval_id``'s prompt ``prompt``."""
        return cls(eval_id, sample, prompt)

    @property
    def evaluation(self) -> bool:
        return self.prompt is not None

    @property
    def episode(self) -> RequestKey:
        """The episode this request is a turn (or an agent's answer) of: no turn, no answer."""
        return replace(self, turn=None, answer=None)

    def at_turn(self, turn: int) -> RequestKey:
        """This episode's turn ``turn``."""
        return replace(self, turn=turn, answer=None)

    def agent_answer(self, request: int, answer: int) -> RequestKey:
        """This agent episode's request ``request``, its answer ``answer``."""
        return replace(self, turn=request, answer=answer)

    def to_id(self) -> str:
        """The engine's request id (the module docstring's forms)."""
        base = (f"{self.group}:{self.index}" if self.prompt is None
                else f"{EVAL_PREFIX}{self.group}:{self.prompt}:{self.index}")
        if self.turn is None:
            return base
        return f"{base}#{self.turn}" if self.answer is None else f"{base}#a{self.turn}.{self.answer}"

    @classmethod
    def parse(cls, rid: str) -> RequestKey:
        """The key of an id :meth:`to_id` wrote; anything else is a one-line ``ValueError``."""
        m = _ID.fullmatch(rid)
        if m is None:
            raise ValueError(f"not a rollout request id: {rid!r} (want GROUP:INDEX or "
                             f"{EVAL_PREFIX}EVAL:PROMPT:SAMPLE, then #TURN or #aREQUEST.ANSWER)")
        ev, prompt, sample, group, index, turn, request, answer = m.groups()
        head = cls(int(group), int(index)) if ev is None else cls.of_eval(int(ev), int(prompt), int(sample))
        if turn is not None:
            return head.at_turn(int(turn))
        return head if request is None else head.agent_answer(int(request), int(answer))
