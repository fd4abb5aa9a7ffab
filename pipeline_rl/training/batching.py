"""Groups -> padded tensors for the trainer, the batch's lag statistics, and the sum of its
statistics over the data-parallel ranks (:func:`sum_over_ranks`).

**Pad, not pack.** Each micro-batch is right-padded to its own longest sequence, after sorting
the batch's sequences by length so sequences of similar length share a micro-batch, and a
micro-batch closes when its padded size (rows x its longest) would pass a token budget, or
earlier where one more pass costs less than the padding it saves. Why:
- After length-sorting, the padding waste is small (measured by :attr:`MicroBatch.pad_frac`);
  the token budget keeps it small when lengths are heavy-tailed (a few long completions no
  longer make every row of the batch as long as they are: the long ones share a small
  micro-batch, the short ones a wide one); and the pass cost
  (``trainer.pass_cost_tokens``) keeps one or two outliers among short rows from tripling
  the width of the whole batch, which the budget alone would allow.
- Packing several sequences into one row needs a block-diagonal attention mask and per-sequence
  position ids; Hugging Face models honour that only with flash-attention's varlen kernels,
  which do not exist on CPU. Padding is exact with every HF causal LM and every attention
  backend (sdpa / eager) on CPU and GPU.
- With right padding and causal attention no real token ever attends to a pad token, so no
  attention mask is needed and positions of real tokens are ``0..len-1`` as at generation.
Length-sorting changes only the order of the terms of the (token-summed) loss.

**Shared prompts** (:class:`SharedPromptBatch`, the default layout of the trainer): a group's
``n`` completions continue one prompt, so the padded layout runs that prompt through the model
``n`` times. The shared layout holds each of a micro-batch's prompts once (``prompt_ids``,
right-padded) and its completions apart (``completion_ids``); the trainer runs the prompts,
then the completions on top of the prompts' KV cache (``pipeline_rl.training.accumulate``).
Rows are sorted by completion length and taken in *blocks* as large as the budget allows;
a block's prompts run once, and its completions are cut into micro-batches by their own
widths, each continuing from that one prompt pass (on the real chat model, a step's
32 completions of 7-32 tokens: one prompt pass instead of two, and a quarter fewer
padded completion slots). Its per-token tensors are completion-aligned:
``mask``/``behav_logp``/the trainer's log-probs are ``[B, T]`` with completion token ``t``
at column ``t``.

Alignment (the one place off-by-ones hide): a sequence is ``prompt_ids + token_ids`` of length
``L = P + T``. The model's logits at position ``i`` predict token ``i + 1``, so the trainer's
per-token tensors have length ``L - 1`` ("target" positions ``j = i``, predicting
``input_ids[j + 1]``), and completion token ``t`` (``0 <= t < T``) sits at target position
``P - 1 + t``. ``mask[j] = 1`` exactly on those ``T`` positions that hold the model's tokens (an episode's environment tokens: 0).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from pipeline_rl.reports import LagStats
from pipeline_rl.samples import Group


class _Counts(ABC):
    """What both layouts derive alike from their ``mask`` [B, *] and ``num_slots``."""

    __slots__ = ()
    mask: torch.Tensor
    num_real_tokens: int

    @property
    @abstractmethod
    def num_slots(self) -> int:
        """Token slots the layout's forward passes run (real and padding)."""

    @property
    def num_seqs(self) -> int:
        return int(self.mask.shape[0])

    @property
    def num_completion_tokens(self) -> int:
        return int(self.mask.sum().item())

    @property
    def pad_frac(self) -> float:
        """Fraction of the token slots the forward passes run that is padding."""
        total = self.num_slots
        return 1.0 - self.num_real_tokens / total if total else 0.0


@dataclass(frozen=True, slots=True)
class MicroBatch(_Counts):
    """One forward/backward pass worth of sequences, right-padded.

    Shapes: ``input_ids`` [B, L] int64; ``mask``, ``behav_logp`` [B, L-1] float32 (target
    positions, see module docstring; ``behav_logp`` is 0 off the mask); ``advantages`` [B]
    float32; ``index`` [B] int64: position of each row in the batch's flat completion order
    (groups in order, completions in order), so per-row results can be put back in place.
    """

    input_ids: torch.Tensor
    mask: torch.Tensor
    behav_logp: torch.Tensor
    advantages: torch.Tensor
    index: torch.Tensor
    num_real_tokens: int   # prompt + completion tokens, padding excluded

    def to(self, device: torch.device) -> "MicroBatch":
        return MicroBatch(self.input_ids.to(device), self.mask.to(device), self.behav_logp.to(device),
                          self.advantages.to(device), self.index, self.num_real_tokens)

    @property
    def num_slots(self) -> int:
        """Token slots the forward pass runs (real and padding)."""
        return int(self.input_ids.numel())


@dataclass(frozen=True, slots=True)
class SharedPromptBatch(_Counts):
    """One forward/backward pass worth of sequences with each prompt held once.

    Shapes: ``prompt_ids`` [G, P] int64, right-padded; ``prompt_lens`` [G] int64 (>= 1);
    ``row_prompt`` [B] int64: the row of ``prompt_ids`` that row ``b`` continues;
    ``completion_ids`` [B, T] int64, right-padded; ``mask``, ``behav_logp`` [B, T] float32
    (completion-aligned: column ``t`` is completion token ``t``; 0 off the mask);
    ``advantages`` [B] float32; ``index`` [B] int64 as in :class:`MicroBatch`.
    ``block``: micro-batches of one block hold the same prompts (all of the block's) and
    are consecutive; the trainer runs them once for the block (``runs_prompts`` on its
    first micro-batch, which alone counts them in ``num_real_tokens`` and ``num_slots``).
    ``num_real_tokens``: the distinct prompts' tokens (where counted) plus the completion tokens.
    """

    prompt_ids: torch.Tensor
    prompt_lens: torch.Tensor
    row_prompt: torch.Tensor
    completion_ids: torch.Tensor
    mask: torch.Tensor
    behav_logp: torch.Tensor
    advantages: torch.Tensor
    index: torch.Tensor
    num_real_tokens: int
    block: int = 0
    runs_prompts: bool = True

    @property
    def num_slots(self) -> int:
        """Token slots the forward passes run (prompts once per block, completions; real and padding)."""
        return int(self.prompt_ids.numel() * self.runs_prompts + self.completion_ids.numel())

    def to(self, device: torch.device) -> "SharedPromptBatch":
        return SharedPromptBatch(self.prompt_ids.to(device), self.prompt_lens.to(device),
                                 self.row_prompt.to(device), self.completion_ids.to(device),
                                 self.mask.to(device), self.behav_logp.to(device),
                                 self.advantages.to(device), self.index, self.num_real_tokens,
                                 self.block, self.runs_prompts)


#: What the trainer trains on: either layout.
AnyMicroBatch = MicroBatch | SharedPromptBatch


@dataclass(frozen=True, slots=True)
class _Row:
    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    advantage: float
    index: int
    group: int     # the row's group: its position in the batch
    model: np.ndarray | None = None   # 1 on the model's tokens (None: all of them)

    def loss_mask(self) -> np.ndarray | float:
        """What the loss mask holds on this row's completion tokens: 1, or 0 on the
        environment's tokens of an episode (they are inputs, never targets)."""
        return 1.0 if self.model is None else self.model.astype(np.float32)

    def behaviour(self) -> np.ndarray:
        """The behaviour log-probs of this row's completion tokens, 0 on the environment's
        (they have none; whatever the message carried there is not read)."""
        return self.logprobs if self.model is None else np.where(self.model != 0, self.logprobs, 0.0)

    @property
    def length(self) -> int:
        return int(self.prompt.shape[0] + self.tokens.shape[0])

    @property
    def width(self) -> int:
        """The row's width in the shared-prompt layout's completion pass."""
        return int(self.tokens.shape[0])


def build_micro_batches(groups: Sequence[Group], advantages: Sequence[np.ndarray], *,
                        micro_batch_size: int, max_tokens: int = 0, pass_tokens: int = 0,
                        pad_id: int = 0) -> list[MicroBatch]:
    """Pad the batch's sequences into micro-batches of at most ``micro_batch_size`` rows and,
    with ``max_tokens > 0``, at most ``max_tokens`` padded tokens (rows x longest row; a
    sequence longer than that gets a micro-batch of its own); with ``pass_tokens > 0``, cut
    where a pass saves more padding than it costs (:func:`_chunks`).

    ``advantages[g]`` holds one advantage per completion of ``groups[g]``. Sequences are sorted
    by length (longest first, stable) before chunking; ``MicroBatch.index`` records the original
    flat position. Raises ValueError on mismatched lengths.
    """
    rows = _sorted_rows(groups, advantages, micro_batch_size, max_tokens, pass_tokens)
    return [_pad(chunk, pad_id) for chunk in _chunks(rows, micro_batch_size, max_tokens, pass_tokens)]


def build_shared_prompt_batches(groups: Sequence[Group], advantages: Sequence[np.ndarray], *,
                                micro_batch_size: int, max_tokens: int = 0, pass_tokens: int = 0,
                                pad_id: int = 0) -> list[SharedPromptBatch]:
    """The batch's rows in the shared-prompt layout, in blocks of micro-batches.

    Rows are sorted by completion length (longest first). A block takes as many of them as
    fit in ``micro_batch_size`` rows and ``max_tokens`` slots (its distinct prompts once,
    ``G x P``, plus ``rows x T``): the trainer runs a block's prompts once, so a block is
    never cut to save padding. Within a block the completions are cut by their own widths
    with :func:`build_micro_batches`' rule (``pass_tokens``; the prompts already ran): a few
    long completions no longer pad every row. Raises ValueError on mismatched lengths."""
    rows = _sorted_rows(groups, advantages, micro_batch_size, max_tokens, pass_tokens, shared=True)
    out: list[SharedPromptBatch] = []
    for k, block in enumerate(_chunks(rows, micro_batch_size, max_tokens, 0, mode="shared")):
        subs = _chunks(block, micro_batch_size, max_tokens, pass_tokens, mode="completions")
        out += [_pad_shared(sub, pad_id, block, k, j == 0) for j, sub in enumerate(subs)]
    return out


def _sorted_rows(groups: Sequence[Group], advantages: Sequence[np.ndarray], micro_batch_size: int,
                 max_tokens: int, pass_tokens: int, shared: bool = False) -> list[_Row]:
    """The batch's sequences, longest first (stable; ``shared``: by completion length),
    after checking the arguments."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1 (got {micro_batch_size})")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0 (got {max_tokens})")
    if pass_tokens < 0:
        raise ValueError(f"pass_tokens must be >= 0 (got {pass_tokens})")
    if len(advantages) != len(groups):
        raise ValueError(f"{len(advantages)} advantage arrays for {len(groups)} groups")
    rows: list[_Row] = []
    for k, (g, adv) in enumerate(zip(groups, advantages, strict=True)):
        if len(adv) != len(g.completions):
            raise ValueError(f"group {g.group_id}: {len(adv)} advantages for {len(g.completions)} completions")
        if g.prompt_ids.shape[0] < 1:
            raise ValueError(f"group {g.group_id}: empty prompt")
        for c, a in zip(g.completions, adv, strict=True):
            rows.append(_Row(g.prompt_ids, c.token_ids, c.logprobs, float(a), len(rows), k, c.mask))
    rows.sort(key=(lambda r: -r.width) if shared else (lambda r: -r.length))  # stable: ties keep their order
    return rows


def _chunks(rows: Sequence[_Row], max_rows: int, max_tokens: int, pass_tokens: int = 0,
            mode: Literal["padded", "shared", "completions"] = "padded") -> list[Sequence[_Row]]:
    """Consecutive runs of ``rows`` (sorted longest first, so a run's first row is its
    longest) of at most ``max_rows`` rows and ``max_tokens`` padded tokens (0: no limit; a
    row wider than that alone).

    ``pass_tokens == 0``: each run takes as many rows as fit. ``pass_tokens > 0``: the
    runs minimise ``sum(rows x longest) + pass_tokens x runs`` -- padded token slots plus
    what one more forward/backward pass costs, in slots -- so a few long rows get a
    narrow pass of their own when that saves more padding than the pass costs (one 16-token
    completion among 31 of 5 tokens: 14.5 ms per step split, 22.5 ms padded, on the
    built-in model), and similar lengths stay together. Exact (dynamic programming over
    the cut points: O(len(rows) x max_rows)).

    ``mode``: what a run's slots are. ``padded``: ``rows x (P + T)``. ``shared`` (rows sorted
    by completion length): ``G x P`` for its distinct prompts, padded to its longest, plus
    ``rows x T``, so the rule also counts the prompts a cut makes run twice.
    ``completions``: ``rows x T`` (the prompts already ran)."""
    n = len(rows)

    def widths(i: int) -> list[int]:   # slots of the runs rows[i:j], j = i+1 .. i+max_rows
        stop = min(n, i + max_rows)
        if mode == "shared":
            return _shared_slots(rows, i, stop)
        width = rows[i].length if mode == "padded" else rows[i].width
        return [(k + 1) * width for k in range(stop - i)]

    slots = [widths(i) for i in range(n)]

    def fit(start: int) -> int:   # rows a run starting at ``start`` may take (at least one)
        return len(slots[start]) if max_tokens == 0 else max(1, sum(1 for c in slots[start] if c <= max_tokens))

    end = [min(n, i + fit(i)) for i in range(n)]   # where the run starting at row i ends
    if pass_tokens > 0:
        best = [0] * (n + 1)    # best[i]: the least cost of rows[i:]
        for i in range(n - 1, -1, -1):
            best[i], end[i] = min((pass_tokens + slots[i][j - i - 1] + best[j], j)
                                  for j in range(i + 1, end[i] + 1))
    runs: list[Sequence[_Row]] = []
    start = 0
    while start < n:
        runs.append(rows[start:end[start]])
        start = end[start]
    return runs


def _shared_slots(rows: Sequence[_Row], start: int, stop: int) -> list[int]:
    """Token slots of the shared-prompt runs ``rows[start:j]`` for ``j`` in ``start+1..stop``
    (rows sorted by completion length, so ``rows[start]`` is the widest)."""
    seen: set[int] = set()
    longest_prompt, out = 0, []
    for j in range(start, stop):
        seen.add(rows[j].group)
        longest_prompt = max(longest_prompt, int(rows[j].prompt.shape[0]))
        out.append(len(seen) * longest_prompt + (j - start + 1) * rows[start].width)
    return out


def _pad(rows: Sequence[_Row], pad_id: int) -> MicroBatch:
    length = max(r.length for r in rows)
    b = len(rows)
    ids = np.full((b, length), pad_id, dtype=np.int64)               # [B, L]
    mask = np.zeros((b, max(length - 1, 0)), dtype=np.float32)       # [B, L-1]
    behav = np.zeros((b, max(length - 1, 0)), dtype=np.float32)      # [B, L-1]
    for i, r in enumerate(rows):
        p, t = r.prompt.shape[0], r.tokens.shape[0]
        ids[i, :p] = r.prompt
        ids[i, p:p + t] = r.tokens
        mask[i, p - 1:p - 1 + t] = r.loss_mask()
        behav[i, p - 1:p - 1 + t] = r.behaviour()
    return MicroBatch(
        input_ids=torch.from_numpy(ids), mask=torch.from_numpy(mask), behav_logp=torch.from_numpy(behav),
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32),
        index=torch.tensor([r.index for r in rows], dtype=torch.int64),
        num_real_tokens=sum(r.length for r in rows))


def _pad_shared(rows: Sequence[_Row], pad_id: int, block: Sequence[_Row] | None = None, block_id: int = 0,
                runs_prompts: bool = True) -> SharedPromptBatch:
    """``rows`` in the shared layout, holding the prompts of all of ``block``'s rows (default: their own)."""
    holder = rows if block is None else block
    groups = list(dict.fromkeys(r.group for r in holder))            # first-seen order
    slot = {g: i for i, g in enumerate(groups)}
    prompts = {r.group: r.prompt for r in holder}
    p_len = max(prompts[g].shape[0] for g in groups)
    t_len = max(r.tokens.shape[0] for r in rows)
    b = len(rows)
    prompt_ids = np.full((len(groups), p_len), pad_id, dtype=np.int64)  # [G, P]
    for i, g in enumerate(groups):
        prompt_ids[i, :prompts[g].shape[0]] = prompts[g]
    ids = np.full((b, t_len), pad_id, dtype=np.int64)                 # [B, T]
    mask = np.zeros((b, t_len), dtype=np.float32)                     # [B, T]
    behav = np.zeros((b, t_len), dtype=np.float32)                    # [B, T]
    for i, r in enumerate(rows):
        t = r.tokens.shape[0]
        ids[i, :t] = r.tokens
        mask[i, :t] = r.loss_mask()
        behav[i, :t] = r.behaviour()
    return SharedPromptBatch(
        prompt_ids=torch.from_numpy(prompt_ids),
        prompt_lens=torch.tensor([prompts[g].shape[0] for g in groups], dtype=torch.int64),
        row_prompt=torch.tensor([slot[r.group] for r in rows], dtype=torch.int64),
        completion_ids=torch.from_numpy(ids), mask=torch.from_numpy(mask), behav_logp=torch.from_numpy(behav),
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32),
        index=torch.tensor([r.index for r in rows], dtype=torch.int64),
        num_real_tokens=sum(prompts[g].shape[0] for g in groups) * runs_prompts + sum(r.tokens.shape[0] for r in rows),
        block=block_id, runs_prompts=runs_prompts)


def lag_stats(groups: Sequence[Group], trainer_version: int) -> LagStats:
    lags: list[int] = []
    mixed = 0
    for g in groups:
        for c in g.completions:
            v = c.model_versions
            if v.size:
                lags.append(max(0, trainer_version - int(v.min())))
                mixed += int(v[0] != v[-1])
    if not lags:
        return LagStats(0.0, 0, (), 0.0)
    hist = np.bincount(np.asarray(lags, dtype=np.int64))
    return LagStats(mean=float(np.mean(lags)), max=int(max(lags)),
                    hist=tuple(int(x) for x in hist), mixed_version_frac=mixed / len(lags))


def sum_over_ranks(values: np.ndarray, world_size: int, device: torch.device) -> np.ndarray:
    """``values`` summed elementwise over the ``world_size`` data-parallel ranks, float64 (an
    all-reduce: every rank calls it with the same shape; on CUDA through the GPU, as NCCL
    needs). One rank: the values themselves, no collective."""
    v = np.asarray(values, dtype=np.float64)
    if world_size == 1:
        return v
    import torch.distributed as dist

    t = torch.tensor(v, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return np.asarray(t.cpu().numpy(), dtype=np.float64)
