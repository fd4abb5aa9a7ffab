"""The built-in model's character ids without its tokenizer: ``encode``/``decode`` and the
``<pad>``/``<eos>`` ids. Invariant: the same ids as the built-in tokenizer
(:func:`~pipeline_rl.models.tiny_llama.char_vocab`), so warm start and probes see what a
rollout worker sees."""

from __future__ import annotations

from typing import Sequence

from pipeline_rl.models.tiny_llama import EOS, PAD, char_vocab

_VOCAB = char_vocab()
PAD_ID, EOS_ID = _VOCAB[PAD], _VOCAB[EOS]
_CHARS = {i: c for c, i in _VOCAB.items()}


def encode(text: str) -> list[int]:
    """Character ids of ``text`` (same ids as the built-in tokenizer's ``encode``)."""
    return [_VOCAB[c] for c in text]


def decode(ids: Sequence[int]) -> str:
    """Text of ``ids`` up to the first ``<eos>``; other special tokens are dropped."""
    out = []
    for i in ids:
        if i == EOS_ID:
            break
        ch = _CHARS.get(int(i), "")
        out.append(ch if len(ch) == 1 else "")
    return "".join(out)

