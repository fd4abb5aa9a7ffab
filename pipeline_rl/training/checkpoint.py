"""Checkpoint layout, run state and validation (no DeepSpeed import here).

A checkpoint is one folder::

    <dir>/config.json, model.safetensors, ...   Hugging Face save_pretrained output
                                                 (a LoRA run: adapter_config.json and
                                                 adapter_model.safetensors, PEFT's files)
    <dir>/tokenizer.json, tokenizer_config.json  copied from the model folder
    <dir>/deepspeed/state/...                    DeepSpeed engine state: optimizer (partitioned
                                                 per rank under ZeRO 1-3), scheduler, fp32 weights
    <dir>/rng_rank<R>.pt                          RNG states of rank R (python, numpy, torch)
    <dir>/run_state.json                          version, data position, layout; written LAST

Invariants:
- The folder loads as-is in transformers (``AutoModelForCausalLM.from_pretrained``) and vLLM;
  a LoRA run's in ``peft.PeftModel.from_pretrained`` and in vLLM with LoRA enabled.
- A checkpoint is complete exactly when ``run_state.json`` is present and valid: the trainer
  writes everything into ``<dir>.partial`` and renames it to ``<dir>`` after every rank has
  finished, so a crash mid-save never leaves a half-written ``<dir>``.
- Every failure to read one raises :class:`CheckpointError` with a one-line message naming the
  folder and what is wrong.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: Bumped when the layout changes incompatibly.
FORMAT_VERSION = 1
RUN_STATE_FILE = "run_state.json"
DEEPSPEED_DIR = "deepspeed"
DEEPSPEED_TAG = "state"
#: Tokenizer files copied next to the weights when the model folder has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing, incomplete, corrupt or incompatible (one-line message)."""


@dataclass(frozen=True, slots=True)
class RunState:
    """What a run needs besides weights and optimizer to continue where it stopped.

    ``version``: batches trained (the policy version of the saved weights; one per batch
    however many PPO epochs it had); ``data_position``: groups trained,
    ``version * groups_per_step`` over all ranks; ``world_size`` / ``zero_stage``: the layout the optimizer state was
    partitioned for (a resume must use the same).
    """

    version: int
    data_position: int
    world_size: int
    zero_stage: int
    format_version: int = FORMAT_VERSION
    saved_unix: float = 0.0

    @classmethod
    def from_json(cls, text: str, where: Path) -> "RunState":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"checkpoint {where.parent}: {where.name} is not valid JSON ({e.msg})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"checkpoint {where.parent}: {where.name} is not a JSON object")
        ints = ("version", "data_position", "world_size", "zero_stage", "format_version")
        bad = [k for k in ints if not isinstance(raw.get(k), int) or raw[k] < 0]
        if bad:
            raise CheckpointError(f"checkpoint {where.parent}: {where.name} lacks valid field(s) {', '.join(bad)}")
        if raw["format_version"] != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {where.parent}: format version {raw['format_version']} "
                                  f"is not the supported {FORMAT_VERSION}")
        return cls(version=raw["version"], data_position=raw["data_position"],
                   world_size=raw["world_size"], zero_stage=raw["zero_stage"],
                   format_version=raw["format_version"], saved_unix=float(raw.get("saved_unix", 0.0)))


def partial_dir(final: Path) -> Path:
    """The folder a checkpoint is written into before it is renamed to ``final``."""
    return final.with_name(final.name + ".partial")


def write_run_state(ckpt_dir: Path, state: RunState) -> None:
    """Write ``run_state.json`` atomically (temp file + rename)."""
    tmp = ckpt_dir / (RUN_STATE_FILE + ".tmp")
    payload = asdict(state) | {"saved_unix": time.time()}
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(ckpt_dir / RUN_STATE_FILE)


def publish_dir(partial: Path, final: Path) -> None:
    """Move a fully written checkpoint into place, replacing an older one of the same name."""
    if final.exists():
        trash = final.with_name(final.name + ".old")
        shutil.rmtree(trash, ignore_errors=True)
        final.replace(trash)
        partial.replace(final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        partial.replace(final)


def copy_tokenizer_files(model_dir: Path, ckpt_dir: Path) -> list[str]:
    """Copy the tokenizer (and generation config) files the model folder has; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        src = model_dir / name
        if src.is_file() and not (ckpt_dir / name).exists():
            shutil.copy2(src, ckpt_dir / name)
            copied.append(name)
    return copied


def read_run_state(ckpt_dir: str | Path) -> RunState:
    """Validate a checkpoint folder and return its run state.

    Checks, in order: the folder exists; ``run_state.json`` is there and valid; the HF config and
    weight files are there and the safetensors headers parse; the DeepSpeed state folder is there.
    Raises :class:`CheckpointError` naming the first problem.
    """
    d = Path(ckpt_dir)
    if not d.is_dir():
        hint = " (an interrupted save left a .partial folder)" if partial_dir(d).is_dir() else ""
        raise CheckpointError(f"checkpoint {d}: no such folder{hint}")
    rs_file = d / RUN_STATE_FILE
    if not rs_file.is_file():
        raise CheckpointError(f"checkpoint {d}: incomplete, {RUN_STATE_FILE} is missing")
    state = RunState.from_json(rs_file.read_text(), rs_file)
    if not (d / "config.json").is_file() and not (d / "adapter_config.json").is_file():
        raise CheckpointError(f"checkpoint {d}: config.json (or a LoRA run's adapter_config.json) is missing")
    _check_safetensors(d)
    ds = d / DEEPSPEED_DIR / DEEPSPEED_TAG
    if not ds.is_dir() or not any(ds.iterdir()):
        raise CheckpointError(f"checkpoint {d}: DeepSpeed state {ds.relative_to(d)} is missing or empty")
    return state


def _check_safetensors(d: Path) -> None:
    from safetensors import safe_open

    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint {d}: no *.safetensors weight file")
    for f in files:
        try:
            with safe_open(str(f), framework="np") as fh:
                keys = list(fh.keys())
                if keys:
                    fh.get_slice(keys[-1])  # touches the header offsets of the last tensor
            size = f.stat().st_size
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"checkpoint {d}: {f.name} is corrupt ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else 'unreadable'})") from None
        if size == 0:
            raise CheckpointError(f"checkpoint {d}: {f.name} is empty")


# ---------------------------------------------------------------------------------------------
# RNG state (saved per rank; only tensors, ints and lists so torch.load(weights_only=True) works)
# ---------------------------------------------------------------------------------------------

def rng_file(ckpt_dir: Path, rank: int) -> Path:
    return ckpt_dir / f"rng_rank{rank}.pt"


def capture_rng() -> dict[str, Any]:
    """Python, numpy and torch (CPU, and CUDA when present) RNG states."""
    import torch

    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, torch.from_numpy(np.asarray(np_keys, dtype=np.int64)), int(np_pos),
                  int(np_has_gauss), float(np_gauss)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    import torch

    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_name, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rng(ckpt_dir: Path, rank: int) -> None:
    import torch

    torch.save(capture_rng(), rng_file(ckpt_dir, rank))


def load_rng(ckpt_dir: Path, rank: int) -> None:
    import torch

    f = rng_file(ckpt_dir, rank)
    if not f.is_file():
        raise CheckpointError(f"checkpoint {ckpt_dir}: {f.name} is missing")
    try:
        state = torch.load(f, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {ckpt_dir}: {f.name} is corrupt ({type(e).__name__})") from None
    restore_rng(state)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest version under ``root`` (``step_*`` folders), or None."""
    best: tuple[int, Path] | None = None
    for d in Path(root).glob("step_*"):
        if d.name.endswith((".partial", ".old")) or not (d / RUN_STATE_FILE).is_file():
            continue
        try:
            v = read_run_state(d).version
        except CheckpointError:
            continue
        if best is None or v > best[0]:
            best = (v, d)
    return best[1] if best else None


def recover_checkpoints(root: str | Path, upto: int | None = None) -> list[str]:
    """Tidy what a save killed part-way left under ``root`` (one line per folder touched);
    ``upto``: only the leftovers of steps up to it (a resume from an older checkpoint
    leaves the later ones to be moved aside whole, ``run.run_folder``).

    A save writes ``step_N.partial`` and renames it; replacing an existing ``step_N`` first
    moves that one to ``step_N.old``. So, for each leftover: a ``.partial`` whose
    ``run_state.json`` is valid (written last: the save had finished) becomes ``step_N``
    when there is none, else it is removed; a ``.old`` is removed when ``step_N`` exists,
    else it is put back (when complete). Afterwards only complete checkpoints remain, and
    the newest of them is the one :func:`latest_checkpoint` names."""
    done: list[str] = []
    for left in sorted(Path(root).glob("step_*")):
        step = step_of(left.name)
        if upto is not None and (step is None or step > upto):
            continue
        for suffix in (".partial", ".old"):
            if not left.name.endswith(suffix):
                continue
            final = left.with_name(left.name.removesuffix(suffix))
            if not final.exists() and _complete(left):
                left.replace(final)
                done.append(f"{left.name} -> {final.name} (complete)")
            else:
                shutil.rmtree(left, ignore_errors=True)
                done.append(f"{left.name} removed")
    return done


def step_of(name: str) -> int | None:
    """The step a checkpoint folder's name gives (``step_N``, ``step_N.partial``,
    ``step_N.old``); None for any other name."""
    digits = name.removeprefix("step_").removesuffix(".partial").removesuffix(".old")
    return int(digits) if name.startswith("step_") and digits.isdigit() else None


def _complete(d: Path) -> bool:
    try:
        read_run_state(d)
    except CheckpointError:
        return False
    return True


def checkpoint_name(version: int) -> str:
    return f"step_{version:06d}"
