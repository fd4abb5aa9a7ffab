"""Sampling and scoring the built-in model in plain transformers (no engine): a batch of
prompts sampled token by token with a KV cache, completions scored by the task's reward,
and the log-probs of given completions. Deterministic for a given ``torch.Generator``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from pipeline_rl.models.char_ids import EOS_ID, PAD_ID, decode, encode
from pipeline_rl.tasks.base import Prompt, Task

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class Rollouts:
    """Sampled completions of a batch of prompts (``B`` = prompts x samples per prompt).

    ``tokens[b, t]`` is the t-th completion token (``PAD_ID`` after the sequence
    ended), ``mask[b, t]`` is 1 on generated tokens including the ``<eos>``,
    ``texts[b]`` the decoded answers, ``rewards[b]`` in [0, 1], ``stopped[b]``
    whether the sequence ended with ``<eos>`` (finish reason ``stop``).
    """

    prompt_ids: list[list[int]]
    tokens: "torch.Tensor"   # [B, T] int64
    mask: "torch.Tensor"     # [B, T] float32
    texts: list[str]
    rewards: "torch.Tensor"  # [B] float32
    stopped: "torch.Tensor"  # [B] bool


def _left_pad(seqs: list[list[int]]) -> tuple["torch.Tensor", "torch.Tensor"]:
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        att[i, width - len(s):] = 1
    return ids, att


def sample(model: "PreTrainedModel", task: Task, prompts: Sequence[Prompt], *, n: int,
           max_new_tokens: int, temperature: float, generator: "torch.Generator") -> Rollouts:
    """Sample ``n`` completions per prompt (plain ancestral sampling, no top-p/top-k) and score them."""
    import torch

    prompt_ids = [encode(p.text) for p in prompts for _ in range(n)]
    out, stopped = generate(model, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                            generator=generator)
    batch = out.shape[0]
    mask = torch.zeros(batch, max_new_tokens)
    for b in range(batch):
        row = out[b].tolist()
        length = row.index(EOS_ID) + 1 if EOS_ID in row else max_new_tokens
        mask[b, :length] = 1.0
    texts = [decode(out[b].tolist()) for b in range(batch)]  # as vLLM's skip_special_tokens text
    metas = [p for p in prompts for _ in range(n)]
    rewards = torch.tensor([task.reward(m.text, txt, m) for m, txt in zip(metas, texts)])
    return Rollouts(prompt_ids, out, mask, texts, rewards, stopped)


def generate(model: "PreTrainedModel", prompt_ids: list[list[int]], *, max_new_tokens: int,
             temperature: float, generator: "torch.Generator") -> tuple["torch.Tensor", "torch.Tensor"]:
    """Sampled continuations ``[B, max_new_tokens]`` of token-id prompts (``PAD_ID`` after a
    row's ``<eos>``) and whether each row stopped with ``<eos>`` ``[B]``."""
    import torch

    ids, att = _left_pad(prompt_ids)                       # [B, P]
    batch = ids.shape[0]
    out = torch.full((batch, max_new_tokens), PAD_ID, dtype=torch.long)
    done = torch.zeros(batch, dtype=torch.bool)
    stopped = torch.zeros(batch, dtype=torch.bool)
    with torch.no_grad():
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        res = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True)
        past, logits = res.past_key_values, res.logits[:, -1]
        for t in range(max_new_tokens):
            probs = torch.softmax(logits.float() / temperature, dim=-1)   # [B, V]
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            nxt = torch.where(done, torch.full_like(nxt, PAD_ID), nxt)
            out[:, t] = nxt
            stopped |= (~done) & (nxt == EOS_ID)
            done |= nxt == EOS_ID
            if bool(done.all()):
                break
            att = torch.cat([att, torch.ones_like(att[:, :1])], dim=1)
            step_pos = pos[:, -1:] + 1
            pos = torch.cat([pos, step_pos], dim=1)
            res = model(input_ids=nxt[:, None], attention_mask=att, position_ids=step_pos,
                        past_key_values=past, use_cache=True)
            past, logits = res.past_key_values, res.logits[:, -1]
    return out, stopped


def completion_logprobs(model: "PreTrainedModel", prompt_ids: list[list[int]],
                        tokens: "torch.Tensor", temperature: float = 1.0) -> "torch.Tensor":
    """Log-probs ``[B, T]`` of ``tokens`` (completions) after their prompts, under ``model``."""
    import torch

    seqs = [p + tokens[b].tolist() for b, p in enumerate(prompt_ids)]
    ids, att = _left_pad(seqs)                            # [B, P+T], completions right-aligned
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=att, position_ids=pos).logits.float()
    T = tokens.shape[1]
    logp = torch.log_softmax(logits[:, -T - 1:-1] / temperature, dim=-1)   # [B, T, V]
    return logp.gather(-1, tokens[:, :, None]).squeeze(-1)               # [B, T]
