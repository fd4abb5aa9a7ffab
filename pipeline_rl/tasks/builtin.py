"""Built-in verifiable tasks for the CPU default: multi-digit addition and digit sorting.

Formats (character-level, what the built-in tokenizer sees one char per token):

- ``addition``: prompt ``"{a}+{b}="`` with ``a, b`` uniform in ``[0, 10**digits)``,
  answer ``str(a + b)`` (no leading zeros), e.g. ``"47+85="`` -> ``"132"``.
- ``sort``: prompt ``"sort {d1 d2 ...}="`` with ``digits`` random digits written
  without separators, answer the digits in ascending order, e.g.
  ``"sort 5193="`` -> ``"1359"``.

Reward: binary exact match, 1.0 when the completion (up to the end-of-sequence
token, surrounding whitespace ignored) equals the answer, else 0.0. A model that
keeps writing after the answer, or never stops, scores 0: the EOS is part of
what is learnt.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from pipeline_rl.tasks.base import Prompt, Split, TaskError, is_held_out, pool_index, strip_eos

#: Draws a prompt may take to land on its split before the task is declared too small.
_MAX_DRAWS = 10_000


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
        want_held_out = self.split == "eval"
        for _ in range(_MAX_DRAWS):
            text, answer = self._draw(rng)
            if is_held_out(text) == want_held_out:
                return Prompt(prompt_id, text, answer)
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
