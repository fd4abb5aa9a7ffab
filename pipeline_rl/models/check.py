"""Start-up checks of a user's model folder, before any process starts.

Each problem is one line naming ``--model.path`` and what is wrong: the folder
does not exist (nothing is ever downloaded: a hub id must already be in the
local Hugging Face cache), it has no ``config.json``, its architecture is not a
causal LM, vLLM has no implementation of it, or it has no tokenizer.

vLLM's list of architectures is read from the installed package's registry
source (``vllm/model_executor/models/registry.py``) without importing vLLM,
which would cost the driver seconds; when that file cannot be read the check
is skipped and vLLM itself reports an unknown architecture at start-up.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline_rl.config import CPU_SUPPORTED_HEAD_DIMS, ModelConfig
from pipeline_rl.rollout.engines.vllm_compat import text_generation_architectures

_FLAG = "--model.path"


class ModelFolderError(ValueError):
    """A model folder the run cannot use; the message is one line naming ``--model.path``."""


def check_model_dir(path: str) -> str:
    """Check the model a run starts from; returns the local folder it resolves to.

    Raises :class:`ModelFolderError` (one line) for a missing folder, a folder
    without ``config.json``, an architecture that is not a causal LM or that vLLM
    cannot run, or a folder without a tokenizer."""
    folder = _resolve(path)
    config = _read_config(folder)
    _check_architecture(folder, config)
    _check_tokenizer(folder)
    return str(folder)


def _resolve(path: str) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise ModelFolderError(f"{_FLAG}: {path} is a file; give the model's folder")
    cached = _from_hf_cache(path)
    if cached is not None:
        return cached
    raise ModelFolderError(f"{_FLAG}: no such folder: {path} (nothing is downloaded: give a local "
                           f"folder, or a hub id already in the local Hugging Face cache)")


def _from_hf_cache(repo_id: str) -> Path | None:
    """The local snapshot of hub id ``repo_id``, when it is already cached."""
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or not a valid id: the caller reports it
        return None


def _read_config(folder: Path) -> dict[str, object]:
    file = folder / "config.json"
    if not file.is_file():
        raise ModelFolderError(f"{_FLAG}: {folder} has no config.json (not a Hugging Face model folder)")
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFolderError(f"{_FLAG}: {file} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelFolderError(f"{_FLAG}: {file} does not hold a JSON object")
    return config


def _check_architecture(folder: Path, config: dict[str, object]) -> None:
    archs = config.get("architectures") or []
    names = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    if not names:
        raise ModelFolderError(f"{_FLAG}: {folder}/config.json names no architecture "
                               f"(an 'architectures' list such as ['LlamaForCausalLM'])")
    causal = [a for a in names if a.endswith(("ForCausalLM", "LMHeadModel"))]
    if not causal:
        raise ModelFolderError(f"{_FLAG}: {folder} holds a {names[0]}, not a causal language model "
                               f"(an architecture ending in ForCausalLM)")
    known = text_generation_architectures()
    if known is not None and not any(a in known for a in causal):
        raise ModelFolderError(f"{_FLAG}: vLLM has no implementation of {causal[0]} (the "
                               f"architecture in {folder}/config.json)")


def _check_tokenizer(folder: Path) -> None:
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - any failure here means: no usable tokenizer
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelFolderError(f"{_FLAG}: {folder} has no usable tokenizer (tokenizer.json or "
                               f"tokenizer_config.json with its vocabulary): {first}") from None


def head_dim_of(model: ModelConfig) -> int | None:
    """Attention head dimension of the configured model, or None when it cannot be read
    without downloading (a hub id that is not a local folder)."""
    if model.path is None:
        return model.head_dim
    cfg_file = Path(model.path) / "config.json"
    if not cfg_file.is_file():
        return None
    cfg = json.loads(cfg_file.read_text())
    cfg = cfg.get("text_config", cfg)
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])


def check_cpu_head_dim(model: ModelConfig) -> None:
    """Raise ValueError when vLLM's CPU attention cannot run this model's head dimension."""
    hd = head_dim_of(model)
    if hd is not None and hd not in CPU_SUPPORTED_HEAD_DIMS:
        flag = "model.num_heads" if model.path is None else "model.path"
        raise ValueError(f"{flag}: attention head dimension {hd} is not supported by vLLM's CPU "
                         f"backend (allowed: {', '.join(map(str, CPU_SUPPORTED_HEAD_DIMS))})")
