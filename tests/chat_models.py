"""Tiny random chat models for the tests of chat episodes: a Qwen2 model with a ChatML
template in the Qwen2.5 style (its structure, with a shorter tool instruction: tools in the system message, tool results as
``<tool_response>`` blocks in a user turn, calls as Hermes ``<tool_call>`` JSON) and a
Llama model with a Llama-3.1 style template (header tokens, ``<|eot_id|>``, tools in the
first user message, results in ``ipython`` turns). Built locally (``benchmarks.archs``:
a byte-level BPE trained on generated text), nothing downloaded; each model's end of turn
(``<|im_end|>``, ``<|eot_id|>``) is its end-of-sequence token, as in the instruct models."""

from __future__ import annotations

import json
from pathlib import Path

from dataclasses import replace

from benchmarks.archs import TINY, TOKENIZER_VOCAB, build_arch_model

QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall one as <tool_call>\\n{\"name\": ..., \"arguments\": {...}}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

LLAMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- if tools is not none and messages | length > 0 %}"
    "{%- set first_user_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- first_user_message + '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def build_chat_model(family: str, out_dir: Path, seed: int = 0) -> Path:
    """A tiny random ``qwen2`` (ChatML) or ``llama`` (Llama-3 template) chat model in ``out_dir``."""
    from transformers import AutoTokenizer

    arch = {"qwen2": "qwen2", "llama3": "llama"}[family]
    # Llama's specials are added after the tokenizer is trained: 64 rows more hold them.
    vocab = 64 * -(-(TOKENIZER_VOCAB + len(LLAMA_SPECIALS)) // 64) if family == "llama3" else None
    out = build_arch_model(arch, out_dir, seed=seed, shape=replace(TINY, vocab_size=vocab))
    tok = AutoTokenizer.from_pretrained(str(out))
    if family == "llama3":
        tok.add_tokens(list(LLAMA_SPECIALS), special_tokens=True)
        tok.bos_token = "<|begin_of_text|>"
        tok.chat_template, end = LLAMA_TEMPLATE, "<|eot_id|>"
    else:
        tok.chat_template, end = QWEN_TEMPLATE, "<|im_end|>"
    tok.eos_token = end
    tok.save_pretrained(str(out))
    end_id = tok.convert_tokens_to_ids(end)
    for name, key, value in (("config.json", "eos_token_id", end_id), ("generation_config.json", "eos_token_id", end_id),
                             ("special_tokens_map.json", "eos_token", end)):
        path = out / name
        if path.is_file():
            cfg = json.loads(path.read_text())
            cfg[key] = value
            path.write_text(json.dumps(cfg, indent=2))
    return out
