"""Built-in verifiable tasks for the CPU default: multi-digit addition, digit sorting, and
counting down (a heavy-tailed completion length).

Formats (character-level, what the built-in tokenizer sees one char per token):

- ``addition``: prompt ``"{a}+{b}="`` with ``a, b`` uniform in ``[0, 10**digits)``,
  answer ``str(a + b)`` (no leading zeros), e.g. ``"47+85="`` -> ``"132"``.
- ``sort``: prompt ``"sort {d1 d2 ...}="`` with ``digits`` random digits written
  without separators, answer the digits in ascending order, e.g.
  ``"sort 5193="`` -> ``"1359"``.
- ``countdown``: prompt ``"countdown {a}="`` with ``a`` written with ``digits`` digits,
  answer every number from ``a`` down to zero, separated by spaces, e.g.
  ``"countdown 004="`` -> ``"004 003 002 001 000"``. The start is log-uniform on
  ``[0, 122]`` (:data:`COUNTDOWN_MAX_START`), so answers take ``digits + 1`` to
  ``123 * (digits + 1)`` tokens with EOS (4 to 492 for 3 digits; median about 40):
  most completions are short and a few very long, as reasoning traces are.

Reward: binary exact match, 1.0 when the completion (up to the end-of-sequence
token, surrounding whitespace ignored) equals the answer, else 0.0. A model that
keeps writing after the answer, or never stops, scores 0: the EOS is part of
what is learnt.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
import math
from dataclasses import dataclass, field

from pipeline_rl.tasks.base import Prompt, Split, TaskError, draw_in_split, pool_index, strip_eos

#: Largest start of a ``countdown`` prompt: 123 three-digit numbers and their separators
#: (492 tokens with EOS) plus the prompt (14) fit the built-in model's 512 positions.
COUNTDOWN_MAX_START = 122


def exact_match(completion: str, answer: str) -> float:
    """1.0 when ``completion`` (cut at EOS, whitespace-stripped) is exactly ``answer``."""
    return 1.0 if strip_eos(completion).strip() == answer else 0.0


@dataclass(frozen=True)
class _SeededTask(ABC):
    """Common part of the built-in tasks: a seeded, stateless prompt pool.

    ``split`` picks the side of the held-out split (:func:`is_held_out`): a prompt id's
    generator draws until it lands on its side, so ``train`` never yields an ``eval``
    prompt text and vice versa."""

    digits: int
    num_prompts: int
    seed: int = 0
    split: Split = "train"
    name: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 12:
            raise TaskError(f"task.digits must be in [1, 12] (got {self.digits})")
        if self.num_prompts < 1:
            raise TaskError(f"task.num_prompts must be >= 1 (got {self.num_prompts})")

    def _rng(self, prompt_id: int) -> random.Random:
        # String seeds hash with SHA-512: stable across processes, Python versions and hosts.
        index = pool_index(prompt_id, self.num_prompts)
        return random.Random(f"{self.name}:{self.split}:{self.seed}:{self.digits}:{index}")

    def prompt(self, prompt_id: int) -> Prompt:
        rng = self._rng(prompt_id)
        found = draw_in_split(prompt_id, self.split, lambda: self._draw(rng))
        if found is not None:
            return found
        raise TaskError(f"task {self.name} with {self.digits} digit(s) has too few distinct prompts "
                        f"for a {self.split} split; use more digits or --eval.every 0")

    @abstractmethod
    def _draw(self, rng: random.Random) -> tuple[str, str]:
        """One random (prompt text, answer)."""

    def reward(self, prompt: str, completion: str, meta: Prompt) -> float:
        return exact_match(completion, meta.answer)


@dataclass(frozen=True)
class AdditionTask(_SeededTask):
    """``a+b=`` -> ``a+b`` with operands of at most ``digits`` digits."""

    name: str = field(default="addition", init=False)

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randrange(10 ** self.digits), rng.randrange(10 ** self.digits)
        return f"{a}+{b}=", str(a + b)


@dataclass(frozen=True)
class SortTask(_SeededTask):
    """``sort 5193=`` -> ``1359``: sort ``digits`` random digits ascending."""

    name: str = field(default="sort", init=False)

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        ds = [rng.randrange(10) for _ in range(self.digits)]
        return f"sort {''.join(map(str, ds))}=", "".join(map(str, sorted(ds)))


def countdown_answer_tokens(digits: int, start: int = COUNTDOWN_MAX_START) -> int:
    """Tokens of a ``countdown`` answer from ``start`` with ``digits``-digit numbers, EOS included."""
    return (start + 1) * (digits + 1)


@dataclass(frozen=True)
class CountdownTask(_SeededTask):
    """``countdown 004=`` -> ``004 003 002 001 000``: every number from the start down to
    zero, written with ``digits`` digits. The start is ``floor(exp(U(0, ln(M + 2)))) - 1``
    for ``M = COUNTDOWN_MAX_START``, so starts of 0-3 are as common as starts of 31-122:
    the completion length is heavy-tailed."""

    name: str = field(default="countdown", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.digits < 3:
            raise TaskError(f"task.digits must be >= 3 for countdown (got {self.digits}): the start "
                            f"goes up to {COUNTDOWN_MAX_START}")

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        top = math.log(COUNTDOWN_MAX_START + 2)
        start = min(COUNTDOWN_MAX_START, int(math.exp(rng.uniform(0.0, top))) - 1)
        numbers = [f"{n:0{self.digits}d}" for n in range(start, -1, -1)]
        return f"countdown {numbers[0]}=", " ".join(numbers)
