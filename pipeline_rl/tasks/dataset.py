"""User data: a JSONL file of ``{"prompt": ..., "answer": ...}`` rows scored by math answer matching.

Everything is checked when the file is loaded, before any worker starts; the
first bad row stops the load with one line naming ``FILE:LINE`` and the
problem (not valid JSON, not an object, a missing or empty field, a prompt
longer than the model's context). Blank lines are skipped. Extra fields are
ignored. ``answer`` may be a JSON string or number.

Prompt order: row ``i`` of the pool is row ``perm[i]`` of the file, ``perm`` a
permutation fixed by the seed (files are often sorted by difficulty or
source); ids beyond the file wrap around.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline_rl.tasks.base import Prompt, TaskError, pool_index
from pipeline_rl.tasks.math_reward import math_reward


class Encoder(Protocol):
    """Anything with a Hugging Face style ``encode(text) -> token ids``."""

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Row:
    """One validated dataset row; ``line`` is its 1-based line number in ``path``."""

    line: int
    prompt: str
    answer: str


def _parse_row(path: Path, line_no: int, line: str, prompt_key: str, answer_key: str) -> Row:
    where = f"{path}:{line_no}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TaskError(f"{where}: expected a JSON object with '{prompt_key}' and '{answer_key}' "
                        f"fields, got {type(obj).__name__}")
    for key in (prompt_key, answer_key):
        if key not in obj:
            raise TaskError(f"{where}: row has no '{key}' field (fields: {', '.join(sorted(obj)) or 'none'})")
    prompt, answer = obj[prompt_key], obj[answer_key]
    if not isinstance(prompt, str) or not prompt.strip():
        raise TaskError(f"{where}: '{prompt_key}' must be a non-empty string")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise TaskError(f"{where}: '{answer_key}' must be a non-empty string or a number")
    return Row(line_no, prompt, str(answer))


def load_rows(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Row]:
    """Read and validate every row of a JSONL file; raises :class:`TaskError` on the first bad one."""
    p = Path(path)
    if not p.is_file():
        raise TaskError(f"task.dataset: no such file: {p}")
    rows: list[Row] = []
    with p.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                rows.append(_parse_row(p, line_no, line, prompt_key, answer_key))
    if not rows:
        raise TaskError(f"task.dataset: {p} holds no rows")
    return rows


def check_prompt_lengths(path: Path, rows: list[Row], tokenizer: Encoder, max_prompt_tokens: int) -> None:
    """Raise :class:`TaskError` naming the first row whose prompt has more than ``max_prompt_tokens`` tokens."""
    for row in rows:
        n = len(tokenizer.encode(row.prompt))
        if n > max_prompt_tokens:
            raise TaskError(f"{path}:{row.line}: prompt is {n} tokens, longer than the {max_prompt_tokens} "
                            f"the model's context leaves for it (rollout.max_model_len - rollout.max_new_tokens)")


@dataclass(frozen=True)
class DatasetTask:
    """Prompts from a validated JSONL file, rewarded by :func:`math_reward`."""

    path: Path
    rows: tuple[Row, ...]
    seed: int = 0
    name: str = "dataset"

    def __post_init__(self) -> None:
        order = list(range(len(self.rows)))
        random.Random(f"dataset:{self.seed}").shuffle(order)
        object.__setattr__(self, "_order", tuple(order))

    @property
    def num_prompts(self) -> int:
        return len(self.rows)

    def prompt(self, prompt_id: int) -> Prompt:
        order: tuple[int, ...] = getattr(self, "_order")
        row = self.rows[order[pool_index(prompt_id, len(self.rows))]]
        return Prompt(prompt_id, row.prompt, row.answer)

    def reward(self, prompt: str, completion: str, meta: Prompt) -> float:
        return math_reward(completion, meta.answer)


def load_dataset_task(path: str | Path, *, seed: int = 0, tokenizer: Encoder | None = None,
                      max_prompt_tokens: int | None = None) -> DatasetTask:
    """Load and validate a JSONL dataset; with a tokenizer and a limit, also check every prompt fits."""
    p = Path(path)
    rows = load_rows(p)
    if tokenizer is not None and max_prompt_tokens is not None:
        check_prompt_lengths(p, rows, tokenizer, max_prompt_tokens)
    return DatasetTask(p, tuple(rows), seed)
