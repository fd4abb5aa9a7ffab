"""The built-in small causal LM: a Llama-architecture model with a character tokenizer.

Built locally (nothing downloaded): :func:`build_tiny_model` writes a Hugging
Face folder (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``) that loads in transformers and in vLLM.

Tokenizer invariants: one token per printable ASCII character (space included),
no token is added on encode (no BOS), decoding concatenates characters, so
``decode(encode(s)) == s`` for every printable-ASCII ``s``. The tokenizer class is
the generic ``PreTrainedTokenizerFast`` (a Qwen2 ``model_type`` would make
transformers 5 rebuild a byte-level pipeline that drops spaces; docs/design.md, platform notes).
"""

from __future__ import annotations

import json
from pathlib import Path

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIALS = (PAD, EOS, UNK)
CHARS = tuple(chr(c) for c in range(32, 127))
VOCAB_SIZE = 128  # len(SPECIALS) + len(CHARS) = 98, padded for aligned embedding rows


def char_vocab() -> dict[str, int]:
    """Token -> id: the specials first (pad=0, eos=1, unk=2), then printable ASCII."""
    return {tok: i for i, tok in enumerate(SPECIALS + CHARS)}


def write_tokenizer(out_dir: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for the character tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": PAD, "eos_token": EOS, "unk_token": UNK,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 4096,
    }, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"pad_token": PAD, "eos_token": EOS, "unk_token": UNK}, indent=2))


def build_tiny_model(out_dir: Path, *, hidden_size: int = 128, num_layers: int = 2,
                     num_heads: int = 4, intermediate_size: int = 256,
                     max_position_embeddings: int = 512, seed: int = 0) -> Path:
    """Build (or reuse, when ``config.json`` with the same shape is there) a randomly
    initialised Llama model with the character tokenizer; returns ``out_dir``.

    Head dimension is ``hidden_size // num_heads`` (vLLM's CPU attention needs 32
    or more; see ``pipeline_rl.config.model_config.CPU_SUPPORTED_HEAD_DIMS``).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        head_dim=hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=None, dtype="float32",
    )
    existing = out_dir / "config.json"
    if existing.is_file() and (out_dir / "model.safetensors").is_file():
        old = json.loads(existing.read_text())
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size", "max_position_embeddings")
        if all(old.get(k) == getattr(cfg, k) for k in keys) and (out_dir / "tokenizer.json").is_file():
            return out_dir
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(out_dir)
    write_tokenizer(out_dir)
    return out_dir
