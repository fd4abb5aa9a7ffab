"""Log-probs of micro-batches under a causal LM (or the DeepSpeed engine around one), at
the sampling temperature: padded rows in one pass, or each group's prompt once with the
completions on top of its KV cache (:func:`shared_prompt_logp`); the sampled entropy of a
step. Used by ``pipeline_rl.training.trainer``."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeline_rl.samples import Completion, Group
from pipeline_rl.training.batching import AnyMicroBatch, MicroBatch, SharedPromptBatch


def sampled_entropy(logps: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> float:
    """Mean ``-log π`` over masked-in tokens with a finite log-prob: logps/masks [B, L-1] each."""
    total, count = 0.0, 0.0
    for logp, mask in zip(logps, masks, strict=True):
        keep = (mask > 0) & torch.isfinite(logp)                                   # [B, L-1]
        total += float(-(logp[keep]).sum())
        count += float(keep.sum())
    return total / count if count else 0.0


def micro_batch_logp(model: Any, mb: AnyMicroBatch, temperature: float,
                     prompts: PromptPass | None = None) -> torch.Tensor:
    """log π of ``mb``'s tokens under ``model`` (a causal LM, or the DeepSpeed engine around
    one) at ``temperature``, laid out like ``mb.mask``; ``prompts``: its block's prompts, run
    once (:func:`run_prompts`), else a shared-prompt ``mb`` runs them itself."""
    if isinstance(mb, SharedPromptBatch):
        logits, ids = _shared_prompt_logits(model, mb, prompts)                       # [B, T, V], [B, T]
        return _target_logp(logits, ids, temperature)                                 # [B, T]
    return padded_logp(model, mb, temperature)


def micro_batch_logp_entropy(model: Any, mb: AnyMicroBatch, temperature: float,
                             prompts: PromptPass | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`micro_batch_logp` and the policy's entropy at each of those positions
    (``H = -Σ_v p_v log p_v`` of the whole distribution at ``temperature``, differentiable),
    both laid out like ``mb.mask``: the entropy bonus's input."""
    if isinstance(mb, SharedPromptBatch):
        logits, targets = _shared_prompt_logits(model, mb, prompts)                  # [B, T, V], [B, T]
    else:
        logits, targets = model(input_ids=mb.input_ids).logits[:, :-1], mb.input_ids[:, 1:]
    scaled = logits.float() / temperature                                            # [B, N, V]
    log_z = torch.logsumexp(scaled, dim=-1)                                          # [B, N]
    logp = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z              # [B, N]
    entropy = log_z - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)               # [B, N]
    return logp, entropy


def padded_logp(model: Any, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """Padded rows, one pass: target positions [B, L-1] (``pipeline_rl.training.batching``)."""
    logits = model(input_ids=mb.input_ids).logits                                   # [B, L, V]
    return _logp_from_logits(logits, mb.input_ids, temperature)                     # [B, L-1]


def shared_prompt_logp(model: Any, mb: SharedPromptBatch, temperature: float) -> torch.Tensor:
    """Shared prompts, two passes: completion-aligned log-probs [B, T].

    1. The prompts ``[G, P]`` (right-padded: under causal attention no real token sees the
       padding), keeping their KV cache. A prompt's logits at its last real position
       predict completion token 0 of every row that continues it.
    2. Completion tokens ``0..T-2`` ``[B, T-1]`` on top of the cache rows of their prompts
       (selected per row with an index, which is differentiable: a prompt's activations
       receive the gradient of every completion continuing it), at positions
       ``P_g .. P_g+T-2`` (as at generation), with the prompts' padding slots masked out;
       their logits predict tokens ``1..T-1``.

    Equal to :func:`padded_logp` on the same rows (to float rounding; tested), at the cost
    of ``G x P + B x T`` token slots instead of ``B x (P + T)``. Raises TypeError for a
    cache that is not a plain per-layer key/value cache (sliding-window or recurrent
    layers), whose continuation would not match the padded pass.
    """
    logits, ids = _shared_prompt_logits(model, mb)                                   # [B, T, V], [B, T]
    return _target_logp(logits, ids, temperature)                                     # [B, T]


@dataclass(frozen=True, slots=True)
class PromptPass:
    """A block's prompts ``[G, P]`` run once, with gradient, for all the block's completion
    passes (the shared-prompt layout's micro-batches of one ``block``).

    Each completion pass continues from *leaves*: detached copies of the prompt pass's
    keys and values ``[G, H, P, D]`` per layer and of its last-position logits ``[G, V]``,
    so its backward stops there and only accumulates their gradients. :meth:`surrogate`
    then carries those gradients through the prompt pass once: the gradient of every
    parameter equals running the prompts with each completion pass (chain rule; tested),
    at the cost of one prompt pass per block instead of one per micro-batch."""

    cache: Any                           # the prompt pass's cache, its tensors in the graph
    last: torch.Tensor                   # [G, V] logits at each prompt's last position (graph)
    keys: tuple[torch.Tensor, ...]       # leaves, one [G, H, P, D] per layer
    values: tuple[torch.Tensor, ...]
    last_leaf: torch.Tensor              # [G, V] leaf

    def continuation(self) -> Any:
        """A fresh cache over the leaves (a completion pass appends to its own)."""
        cache = copy.copy(self.cache)
        cache.layers = [copy.copy(layer) for layer in self.cache.layers]
        for layer, k, v in zip(cache.layers, self.keys, self.values, strict=True):
            layer.keys, layer.values = k, v
        return cache

    def surrogate(self) -> torch.Tensor | None:
        """``Σ <prompt-pass tensor, its leaf's gradient>``: its backward is the prompt pass's
        backward under every completion pass run on the leaves. None when none ran."""
        graph = [*(layer.keys for layer in self.cache.layers), *(layer.values for layer in self.cache.layers),
                 self.last]
        leaves = [*self.keys, *self.values, self.last_leaf]
        terms = [(t * leaf.grad).sum() for t, leaf in zip(graph, leaves, strict=True) if leaf.grad is not None]
        return torch.stack(terms).sum() if terms else None


def run_prompts(model: Any, mb: SharedPromptBatch) -> PromptPass:
    """``mb``'s prompts (its block's: every micro-batch of a block holds them) run once."""
    cache, last = _prompt_pass(model, mb)
    leaf = lambda t: t.detach().requires_grad_(t.requires_grad)   # noqa: E731
    return PromptPass(cache, last, tuple(leaf(layer.keys) for layer in cache.layers),
                      tuple(leaf(layer.values) for layer in cache.layers), leaf(last))


def _prompt_pass(model: Any, mb: SharedPromptBatch) -> tuple[Any, torch.Tensor]:
    """The prompts' forward: their cache and the logits at each prompt's last position [G, V]."""
    # Only the positions some prompt ends at go through the LM head (``logits_to_keep``, a
    # sorted index over P): the other prompt positions' logits are never used.
    g = mb.prompt_ids.shape[0]
    ends = mb.prompt_lens - 1                                                        # [G]
    keep = torch.unique(ends)                                                        # [U], U <= G
    out = model(input_ids=mb.prompt_ids, use_cache=True, logits_to_keep=keep)        # logits [G, U, V]
    last = out.logits[torch.arange(g, device=ends.device), torch.searchsorted(keep, ends)]   # [G, V]
    cache = out.past_key_values
    kinds = {type(layer).__name__ for layer in getattr(cache, "layers", [None])}
    if kinds != {"DynamicLayer"}:
        raise TypeError(f"cache layers {sorted(kinds)} are not plain key/value layers")
    return cache, last


def _shared_prompt_logits(model: Any, mb: SharedPromptBatch,
                          prompts: PromptPass | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits predicting each completion token [B, T, V] and those tokens [B, T]
    (:func:`shared_prompt_logp`'s two passes; the first from ``prompts`` when given)."""
    ids = mb.completion_ids                                                          # [B, T]
    b, t = ids.shape
    if prompts is None:
        cache, last = _prompt_pass(model, mb)
    else:
        cache, last = prompts.continuation(), prompts.last_leaf
    logits = last[mb.row_prompt].unsqueeze(1)                                        # [B, 1, V]
    if t > 1:
        cache.batch_select_indices(mb.row_prompt)                                    # [G, ...] -> [B, ...]
        p = mb.prompt_ids.shape[1]
        valid = torch.arange(p, device=ids.device) < mb.prompt_lens.unsqueeze(1)       # [G, P]
        attention = torch.cat([valid[mb.row_prompt], torch.ones(b, t - 1, dtype=torch.bool, device=ids.device)],
                              dim=1).long()                                           # [B, P+T-1]
        positions = (mb.prompt_lens[mb.row_prompt].unsqueeze(1)
                     + torch.arange(t - 1, device=ids.device))                        # [B, T-1]
        rest = model(input_ids=ids[:, :-1], past_key_values=cache, attention_mask=attention,
                     position_ids=positions, use_cache=True).logits                   # [B, T-1, V]
        logits = torch.cat([logits, rest], dim=1)                                    # [B, T, V]
    return logits, ids


def sharing_check_groups(vocab_size: int) -> list[Group]:
    """Two groups with prompts of 3 and 5 tokens and completions of 1-3 (fixed seed)."""
    rng = np.random.default_rng(0)
    groups = []
    for gid, (p, lengths) in enumerate(((3, (2, 3)), (5, (1, 3)))):
        comps = tuple(Completion(rng.integers(1, vocab_size, t, dtype=np.int32), np.zeros(t, np.float32),
                                 np.zeros(t, np.int32), 0.0, "stop") for t in lengths)
        groups.append(Group(gid, gid, 0, rng.integers(1, vocab_size, p, dtype=np.int32), comps))
    return groups


def _logp_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of the next token: logits [B, L, V], input_ids [B, L] -> [B, L-1]."""
    return _target_logp(logits[:, :-1], input_ids[:, 1:], temperature)             # [B, L-1]


def _target_logp(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at ``targets``: logits [B, N, V], targets [B, N] -> [B, N]."""
    wide = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()   # bf16/fp16 -> fp32
    out = _TargetLogp.apply(wide, targets, float(temperature))
    assert isinstance(out, torch.Tensor)
    return out


class _TargetLogp(torch.autograd.Function):
    """log softmax(x / T) at the targets, with the vocabulary-wide work done in as few passes
    over the [B, N, V] logits as autograd allows: the forward keeps only the logits (already
    alive for the LM head's backward) and ``log Z`` [B, N]; the backward writes
    ``d/dx = g/T (onehot(target) - softmax(x / T))`` into one new tensor, in place.

    Equal to ``gather - logsumexp`` and its autograd gradient (to float rounding; tested);
    a full step of the real model spends about 0.5 s less in its log-probs at T = 1."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        scaled = logits if temperature == 1.0 else logits / temperature             # [B, N, V]
        log_z = torch.logsumexp(scaled, dim=-1)                                      # [B, N]
        ctx.save_for_backward(logits, targets, log_z)
        ctx.temperature = temperature
        return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z         # [B, N]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, log_z = ctx.saved_tensors
        t = ctx.temperature
        scaled = logits if t == 1.0 else logits / t                                  # [B, N, V]
        d = torch.sub(scaled, log_z.unsqueeze(-1)).exp_()                            # softmax [B, N, V]
        d.mul_(grad.neg().unsqueeze(-1))
        d.scatter_add_(-1, targets.unsqueeze(-1), grad.unsqueeze(-1))
        if t != 1.0:
            d.div_(t)
        return d, None, None
