"""The model's tokenizer as the tasks need it: the one the workers render prompts with
(:func:`task_tokenizer`), and the light one the driver counts prompt tokens with (:func:`check_tokenizer`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline_rl.tasks.dataset import Encoder

if TYPE_CHECKING:
    from pipeline_rl.tasks.task_config import TaskConfig


def task_tokenizer(cfg: "TaskConfig", model_dir: str, *, max_prompt_tokens: int | None = None) -> Encoder | None:
    """The tokenizer of the model in ``model_dir`` (``transformers.AutoTokenizer``, imported
    here) when prompts need it -- for its chat template or a length check -- else None
    (``chat_template=none`` and no limit: nothing is loaded)."""
    if cfg.chat_template == "none" and max_prompt_tokens is None:
        return None
    return _auto_tokenizer(model_dir)


def _auto_tokenizer(model_dir: str) -> Encoder:
    from transformers import AutoTokenizer

    tokenizer: Encoder = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer


class _LightEncoder:
    """``encode`` of a ``tokenizer.json`` through the ``tokenizers`` library (milliseconds
    to load, where ``transformers.AutoTokenizer`` takes seconds to import): for counting
    prompt tokens only. Adds BOS/EOS as ``tokenizer_config.json`` asks, as Hugging Face's
    fast tokenizer does."""

    def __init__(self, tokenizer: Any, bos_id: int | None, eos_id: int | None) -> None:
        self._tok, self._bos, self._eos = tokenizer, bos_id, eos_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._bos is not None and ids[:1] != [self._bos]:
            ids = [self._bos, *ids]
        if add_special_tokens and self._eos is not None and ids[-1:] != [self._eos]:
            ids = [*ids, self._eos]
        return ids


def _light_encoder(model_dir: str) -> Encoder | None:
    """A :class:`_LightEncoder` for the folder's tokenizer, or None when it needs
    transformers (no ``tokenizer.json``, a chat template, an unreadable config)."""
    folder = Path(model_dir)
    if not (folder / "tokenizer.json").is_file():
        return None
    if any((folder / name).exists() for name in ("chat_template.jinja", "chat_template.json")):
        return None
    try:
        conf = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(conf, dict) or conf.get("chat_template"):
        return None
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - any problem: let transformers load (and report) it
        return None

    def special(flag: str, key: str) -> int | None:
        name = conf.get(key)
        if not conf.get(flag) or not isinstance(name, str):
            return None
        token_id = tok.token_to_id(name)
        return int(token_id) if token_id is not None else None

    return _LightEncoder(tok, special("add_bos_token", "bos_token"), special("add_eos_token", "eos_token"))


def check_tokenizer(cfg: "TaskConfig", model_dir: str) -> Encoder:
    """The tokenizer the driver checks prompt lengths with before anything starts.

    Built-in tasks on a tokenizer without a chat template need only token counts: the
    ``tokenizers`` library reads ``tokenizer.json`` directly (saves the seconds of
    importing transformers on every start). Otherwise the model's
    ``transformers.AutoTokenizer`` (chat template, datasets: exactly what the workers use)."""
    light = _light_encoder(model_dir) if cfg.name != "dataset" else None
    return light if light is not None else _auto_tokenizer(model_dir)
