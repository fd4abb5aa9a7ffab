"""``calc``: a multi-turn, tool-using task the built-in model can solve only with its tool.

Format (character-level: one token per character; ``<eos>`` is the end-of-sequence token,
which ends a model turn)::

    calc 4821*7396=[4821*7396]<eos>=35655316;35655316<eos>

is the prompt ``calc 4821*7396=``, model turn 1 (a call) ``[4821*7396]<eos>``, the tool's
reply ``=35655316;`` (environment tokens) and model turn 2 (the answer) ``35655316<eos>``.

- The prompt is ``calc {a}*{b}=`` with ``a, b`` of exactly ``digits`` digits (no leading
  zero), uniform; the answer is ``str(a * b)``. A product of two 4-digit numbers is far
  beyond what the 0.36 M-parameter model computes in one pass.
- A call is ``[{x}{op}{y}]`` (:data:`CALL`: integers and one of ``+ - *``; the operator
  names the tool). :class:`CalcEnv` answers it with ``={result};`` (:data:`REPLY`: printable
  characters only, as the built-in tokenizer has no newline) and the model goes on.
- A turn without a call ends the episode: reward 1.0 when that turn (cut at ``<eos>``,
  whitespace stripped) is exactly the answer, else 0.0 (:meth:`CalcEnv.score`).

The warm start (:meth:`CalcTask.demonstration`) teaches both ways to answer: the tool
episode above, and a *decoy*, a direct answer in one turn: the operands written together
(``48217396<eos>``), a plausible-looking number that is never the product (``a * 10**d +
b > a * b`` for ``b < 10**d``). Mostly shown the decoy, the model's greedy answer is the
decoy and it calls the tool in about a quarter of its samples: RL must make the call its
first choice, and it can only score by copying what the tool said.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from pipeline_rl.tasks.base import Part, Prompt, TaskError
from pipeline_rl.tasks.builtin import _SeededTask, exact_match
from pipeline_rl.tasks.env import EnvFactory, ToolEnv

#: A call: ``[x op y]``; the group ``name`` is the operator (the tool), ``arg`` the whole
#: expression. Operands are 1-24 digits, so a tool never multiplies unbounded numbers.
CALL = re.compile(r"\[(?P<arg>\d{1,24}(?P<name>[-+*])\d{1,24})\]")

#: The tool's answer to a call.
REPLY = "={result};"

#: Most operand digits a ``calc`` prompt takes (the product then has up to 12 digits).
MAX_DIGITS = 6


def _apply(op: Callable[[int, int], int], sign: str) -> Callable[[str], str]:
    def tool(arg: str) -> str:
        left, _, right = arg.partition(sign)
        return str(op(int(left), int(right)))
    tool.__doc__ = f"``x{sign}y`` -> the result, in decimal (arguments matched by :data:`CALL`)."
    return tool


class CalcEnv(ToolEnv):
    """The calculator: ``[4821*7396]`` -> ``=35655316;``; a turn without a call ends the
    episode, scored by :meth:`score`. Stateless apart from the episode's prompt: one
    instance per episode (the factory is the class)."""

    tools: ClassVar[dict[str, Callable[[str], str]]] = {
        "+": _apply(lambda x, y: x + y, "+"),
        "-": _apply(lambda x, y: x - y, "-"),
        "*": _apply(lambda x, y: x * y, "*"),
    }
    call: ClassVar[re.Pattern[str]] = CALL
    reply_format: ClassVar[str] = REPLY

    def score(self, prompt: Prompt, turn: str) -> float:
        """1.0 when ``turn`` (cut at ``<eos>``, stripped) is exactly the answer, else 0.0."""
        return exact_match(turn, prompt.answer)


@dataclass(frozen=True)
class CalcTask(_SeededTask):
    """``calc 4821*7396=`` -> ``35655316``, reached through :class:`CalcEnv` (module doc).

    Invariants: prompts are deterministic per ``(seed, split, digits, prompt_id)`` and
    the splits disjoint (:class:`~pipeline_rl.tasks.builtin._SeededTask`); the single-turn
    ``reward`` is the same exact match the environment scores a final turn with."""

    name: str = field(default="calc", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.digits > MAX_DIGITS:
            raise TaskError(f"task.digits must be <= {MAX_DIGITS} for calc (got {self.digits})")

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        low, high = 10 ** (self.digits - 1) if self.digits > 1 else 1, 10 ** self.digits
        a, b = rng.randrange(low, high), rng.randrange(low, high)
        return f"calc {a}*{b}=", str(a * b)

    def env_factory(self) -> EnvFactory:
        """Each episode gets a new :class:`CalcEnv` (see :func:`pipeline_rl.tasks.env.task_env_factory`)."""
        return CalcEnv

    @staticmethod
    def expression(prompt: Prompt) -> str:
        """The prompt's expression, ``4821*7396`` (what a right call holds)."""
        return prompt.question[len("calc "):-1]

    def demonstration(self, prompt: Prompt, decoy: bool) -> tuple[Part, ...]:
        """What the warm start shows after ``prompt``: the tool episode (call, the tool's
        reply, the answer) or, with ``decoy``, the direct wrong answer (the operands
        written together). The reply is exactly what :class:`CalcEnv` answers."""
        expr = self.expression(prompt)
        if decoy:
            return ((expr.replace("*", ""), True),)
        call = f"[{expr}]"
        env = CalcEnv()
        env.reset(prompt)
        reply = env.step(call + "<eos>").text
        return ((call, True), (reply, False), (prompt.answer, True))


def episode_text(parts: tuple[Part, ...], eos: str = "<eos>") -> str:
    """The text of an episode after its prompt: each model part followed by ``eos``."""
    return "".join(text + (eos if by_model else "") for text, by_model in parts)
