"""User data: a local file of prompt/answer rows, scored by math answer matching.

Formats, chosen by the path:

- ``.jsonl``: JSON Lines, read here line by line; blank lines are skipped.
- ``.json`` (a JSON array of objects, or JSON Lines), ``.parquet``, ``.arrow``
  (Arrow IPC, as the ``datasets`` package writes it) and ``.csv``: read with the
  ``datasets`` package in streaming mode, from the local file only (nothing is
  downloaded or copied into a cache; ``HF_DATASETS_OFFLINE`` is left as set).
- a folder written by ``Dataset.save_to_disk``: ``datasets.load_from_disk``
  (memory-mapped); a ``DatasetDict`` folder must hold a single split, or the
  split's subfolder is given instead.

``datasets`` is imported only when one of those is read. The prompt and answer
are the columns ``--task.prompt_field`` and ``--task.answer_field`` name
(default ``prompt`` and ``answer``); other columns are ignored. ``answer`` may be
a string or a number.

Everything is checked when the file is loaded, before any worker starts; the
first problem stops the load with one line naming where it is: ``FILE:LINE``
(1-based line) for JSONL, ``FILE[i]`` (0-based row index, as ``ds[i]``) for the
other formats. Problems: not valid JSON, not an object, a missing column (the
message lists the columns there are), an empty prompt or answer, a prompt
longer than the model's context.

Prompt order: row ``i`` of the pool is row ``perm[i]`` of the file, ``perm`` a
permutation fixed by the seed (files are often sorted by difficulty or
source); ids beyond the file wrap around.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from pipeline_rl.tasks.base import HELD_OUT_PER_MILLE, Prompt, Split, TaskError, is_held_out, pool_index
from pipeline_rl.tasks.math_reward import math_reward

#: File suffix -> the ``datasets`` packaged builder that reads it.
BUILDERS: dict[str, str] = {".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
FORMATS = ".jsonl, .json, .parquet, .arrow, .csv or a save_to_disk folder"
_BATCH = 1024


class Encoder(Protocol):
    """Anything with a Hugging Face style ``encode(text) -> token ids``."""

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Row:
    """One validated row. ``pos`` locates it in its file: the 1-based line of a JSONL
    file, else the 0-based row index (see :func:`location`)."""

    pos: int
    prompt: str
    answer: str
    columns: Mapping[str, object] = field(default_factory=dict, compare=False)


def location(path: Path, pos: int) -> str:
    """Where a row is, for messages: ``FILE:LINE`` for JSONL, ``FILE[i]`` otherwise."""
    return f"{path}:{pos}" if path.suffix == ".jsonl" else f"{path}[{pos}]"


def _check_values(where: str, prompt: object, answer: object, prompt_key: str,
                  answer_key: str) -> tuple[str, str]:
    """The prompt and answer as strings; raises :class:`TaskError` when either is empty or mistyped."""
    if not isinstance(prompt, str) or not prompt.strip():
        got = "" if isinstance(prompt, str) else f" (got {type(prompt).__name__})"
        raise TaskError(f"{where}: '{prompt_key}' must be a non-empty string{got}")
    bad_number = isinstance(answer, float) and not math.isfinite(answer)
    if (isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or bad_number
            or not str(answer).strip()):
        raise TaskError(f"{where}: '{answer_key}' must be a non-empty string or a number")
    return prompt, str(answer)


def _parse_line(path: Path, line_no: int, line: str, prompt_key: str, answer_key: str,
                keep: bool = False) -> Row:
    where = location(path, line_no)
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TaskError(f"{where}: expected a JSON object with '{prompt_key}' and '{answer_key}' "
                        f"fields, got {type(obj).__name__}")
    for key, flag in ((prompt_key, "prompt_field"), (answer_key, "answer_field")):
        if key not in obj:
            raise TaskError(f"{where}: row has no '{key}' field (task.{flag}; fields: "
                            f"{', '.join(sorted(obj)) or 'none'})")
    prompt, answer = _check_values(where, obj[prompt_key], obj[answer_key], prompt_key, answer_key)
    return Row(line_no, prompt, answer, _others(obj, prompt_key) if keep else {})


def _others(row: Mapping[str, object], prompt_key: str) -> dict[str, object]:
    """A row's columns but the prompt (a reward of TRL's or verl's form gets them)."""
    return {k: v for k, v in row.items() if k != prompt_key}


def load_jsonl_rows(path: Path, prompt_key: str, answer_key: str, keep: bool = False) -> list[Row]:
    """Every row of a JSONL file, validated (``keep``: with its other columns); raises on
    the first bad line."""
    rows: list[Row] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                rows.append(_parse_line(path, line_no, line, prompt_key, answer_key, keep))
    return rows


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _open_table(path: Path) -> Any:
    """A ``datasets`` Dataset or IterableDataset over the local ``path`` (no download, no cache)."""
    try:
        import datasets
    except ImportError:
        raise TaskError(f"task.dataset: reading {path.name} needs the 'datasets' package "
                        f"(pip install datasets)") from None
    if path.is_dir():
        try:
            ds = datasets.load_from_disk(str(path))
        except FileNotFoundError:
            raise TaskError(f"task.dataset: {path} is a folder but not one written by save_to_disk "
                            f"(give {FORMATS})") from None
        if isinstance(ds, datasets.DatasetDict):
            if len(ds) != 1:
                raise TaskError(f"task.dataset: {path} holds splits {', '.join(ds)}; give one of "
                                f"them, e.g. {path / next(iter(ds))}")
            ds = next(iter(ds.values()))
        return ds
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise TaskError(f"task.dataset: {path}: unknown format '{path.suffix}' (give {FORMATS})")
    return datasets.load_dataset(builder, data_files=str(path.resolve()), split="train", streaming=True)


def _check_columns(path: Path, columns: list[str], prompt_key: str, answer_key: str) -> None:
    for key, flag in ((prompt_key, "prompt_field"), (answer_key, "answer_field")):
        if key not in columns:
            raise TaskError(f"task.{flag}: {path} has no column '{key}' "
                            f"(columns: {', '.join(columns) or 'none'})")


def _batches(path: Path, ds: Any) -> Iterator[dict[str, list[Any]]]:
    """``ds``'s rows in column batches; a read error is a one-line :class:`TaskError`."""
    it = iter(ds.iter(batch_size=_BATCH))
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except Exception as e:  # pyarrow / datasets errors on a malformed file
            raise TaskError(f"task.dataset: cannot read {path}: {_first_line(e)}") from None
        yield batch


def load_table_rows(path: Path, prompt_key: str, answer_key: str, keep: bool = False) -> list[Row]:
    """Every row of a non-JSONL dataset, validated; raises on a missing column or the first bad row."""
    try:
        ds = _open_table(path)
    except TaskError:
        raise
    except Exception as e:  # datasets / pyarrow refusing the file
        raise TaskError(f"task.dataset: cannot read {path}: {_first_line(e)}") from None
    if ds.column_names is not None:
        _check_columns(path, list(ds.column_names), prompt_key, answer_key)
    rows: list[Row] = []
    for batch in _batches(path, ds):
        _check_columns(path, list(batch), prompt_key, answer_key)
        for i, (prompt, answer) in enumerate(zip(batch[prompt_key], batch[answer_key])):
            where = location(path, len(rows))
            checked = _check_values(where, prompt, answer, prompt_key, answer_key)
            others = _others({k: v[i] for k, v in batch.items()}, prompt_key) if keep else {}
            rows.append(Row(len(rows), *checked, others))
    return rows


def load_rows(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer",
              keep_columns: bool = False) -> list[Row]:
    """Read and validate every row of a dataset (any supported format), with their other
    columns when ``keep_columns``; raises :class:`TaskError` on the first problem."""
    p = Path(path)
    if not p.exists():
        raise TaskError(f"task.dataset: no such file: {p} (give a local {FORMATS}; nothing is downloaded)")
    if p.suffix == ".jsonl" and p.is_file():
        rows = load_jsonl_rows(p, prompt_key, answer_key, keep_columns)
    else:
        rows = load_table_rows(p, prompt_key, answer_key, keep_columns)
    if not rows:
        raise TaskError(f"task.dataset: {p} holds no rows")
    return rows


def prompt_tokens(tokenizer: Encoder, text: str, templated: bool) -> int:
    """Tokens ``text`` takes; chat-template output already holds its special tokens,
    so none are added to it."""
    if templated:
        enc: Any = tokenizer
        return len(enc.encode(text, add_special_tokens=False))
    return len(tokenizer.encode(text))


def check_prompt_lengths(path: Path, rows: list[Row] | tuple[Row, ...], tokenizer: Encoder,
                         max_prompt_tokens: int, render: Callable[[str], str] | None = None) -> None:
    """Raise :class:`TaskError` naming the first row whose prompt (rendered by ``render``,
    when given) has more than ``max_prompt_tokens`` tokens."""
    for row in rows:
        text = row.prompt if render is None else render(row.prompt)
        n = prompt_tokens(tokenizer, text, render is not None)
        if n > max_prompt_tokens:
            raise TaskError(f"{location(path, row.pos)}: prompt is {n} tokens, longer than the "
                            f"{max_prompt_tokens} the model's context leaves for it "
                            f"(rollout.max_model_len - rollout.max_new_tokens)")


@dataclass(frozen=True)
class DatasetTask:
    """Prompts from a validated dataset, rewarded by :func:`math_reward`."""

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
        return Prompt(prompt_id, row.prompt, row.answer, columns=row.columns)

    @property
    def column_names(self) -> frozenset[str]:
        """The columns every row has (a reward of TRL's form may ask for them by name);
        only those kept (``keep_columns``) besides the prompt and the answer."""
        names = frozenset.intersection(*(frozenset(r.columns) for r in self.rows)) if self.rows else frozenset()
        return names | {"prompt", "answer"}

    def reward(self, prompt: str, completion: str, meta: Prompt) -> float:
        return math_reward(completion, meta.answer)


def load_dataset_task(path: str | Path, *, seed: int = 0, prompt_field: str = "prompt",
                      answer_field: str = "answer", tokenizer: Encoder | None = None,
                      max_prompt_tokens: int | None = None,
                      render: Callable[[str], str] | None = None, split: Split | None = None,
                      keep_columns: bool = False) -> DatasetTask:
    """Load and validate a dataset; with a tokenizer and a limit, also check every prompt
    (as ``render`` turns it into model input, when given) fits. ``split`` keeps only the
    rows on that side of the held-out split (:func:`is_held_out` of the prompt); None
    keeps them all."""
    p = Path(path)
    rows = load_rows(p, prompt_key=prompt_field, answer_key=answer_field, keep_columns=keep_columns)
    if split is not None:
        rows = [r for r in rows if is_held_out(r.prompt) == (split == "eval")]
        if not rows:
            raise TaskError(f"{p}: no rows for the {split} split (the prompts hashed to "
                            f"{HELD_OUT_PER_MILLE / 10:g}% go to evaluation); give --eval.dataset FILE "
                            f"or --eval.every 0")
    if tokenizer is not None and max_prompt_tokens is not None:
        check_prompt_lengths(p, rows, tokenizer, max_prompt_tokens, render)
    return DatasetTask(p, tuple(rows), seed)
