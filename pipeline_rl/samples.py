"""The sample types that cross the rollout -> buffer -> trainer path.

A :class:`Group` is the unit of transport and storage: the ``n`` completions of
one prompt (GRPO needs whole groups). Token arrays are numpy arrays with fixed
dtypes so they can travel as raw little-endian bytes (see ``pipeline_rl.wire``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

#: Why a completion (or episode) ended: the model stopped, a token cap, aborted, a turn cap.
FinishReason = Literal["stop", "length", "abort", "turns"]
FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "abort", "turns")

NEWEST_VERSION = 2**31 - 1  # oldest version of a group with no tokens: never stale
I32 = npt.NDArray[np.int32]
F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]
_I32_LE, _F32_LE, _U8 = np.dtype("<i4"), np.dtype("<f4"), np.dtype("u1")
_ARRAY_FIELDS = (("token_ids", _I32_LE), ("logprobs", _F32_LE), ("versions", _I32_LE))


def wire_array(a: object, dtype: np.dtype, what: str) -> np.ndarray:
    """``a`` as a 1-D C-contiguous array of ``dtype`` -- itself when it already is one,
    so the wire encoder can copy its bytes as they are. Raises ValueError naming
    ``what`` for anything that is not 1-D."""
    if type(a) is not np.ndarray or a.dtype != dtype or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a, dtype=dtype)
    if a.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {a.shape}")
    return a


@dataclass(frozen=True, slots=True, eq=False)
class Completion:
    """One sampled completion of a prompt -- or a whole episode of several turns: the
    model's turns and the environment's replies in order.

    Invariants: ``token_ids``, ``logprobs``, ``versions`` (and ``mask``, when given)
    share one length (possibly 0). ``mask[t]`` is 1 where the model sampled token t and 0
    where the environment wrote it; None means every token is the model's. On model
    tokens: ``logprobs`` are the behaviour log-probs after temperature (<= 0, ``-inf``
    only if the sampler produced an impossible token) and ``versions[t]`` the policy
    version of the weights that produced token t, non-decreasing along the model's
    tokens; on environment tokens both are placeholders (0, and the version before) that
    no loss, correction, lag or diagnostic reads. ``reward`` is finite.

    The three arrays are stored 1-D, C-contiguous, as little-endian int32 /
    float32 / int32 (converted on construction when they are not), so the wire
    encoder copies their bytes as they are.
    """

    token_ids: I32
    logprobs: F32
    versions: I32
    reward: float
    finish_reason: FinishReason
    mask: U8 | None = None

    def __post_init__(self) -> None:
        for name, dtype in _ARRAY_FIELDS:
            object.__setattr__(self, name, wire_array(getattr(self, name), dtype, f"Completion.{name}"))
        if self.mask is not None:
            mask = wire_array(self.mask, _U8, "Completion.mask")
            if mask.size and mask.max() > 1:
                raise ValueError("Completion.mask holds values other than 0 and 1")
            object.__setattr__(self, "mask", None if mask.all() else mask)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def model_versions(self) -> I32:
        """The versions of the model's tokens (all of them, without a mask)."""
        return self.versions if self.mask is None else self.versions[self.mask != 0]

    @property
    def min_version(self) -> int | None:
        v = self.model_versions
        return int(v.min()) if v.size else None

    @property
    def num_versions(self) -> int:
        """How many distinct policy versions produced this completion's model tokens."""
        return int(np.unique(self.model_versions).size)


@dataclass(frozen=True, slots=True, eq=False)
class GroupColumns:
    """A group's completions as flat arrays (the wire layout): completion ``i`` is
    ``token_ids[ends[i-1]:ends[i]]`` (likewise ``logprobs``, ``versions``), with
    ``ends = cumsum(lengths)``. ``finish`` indexes :data:`FINISH_REASONS`; ``mask``
    (None: all model tokens) marks the model's tokens, as in :class:`Completion`.

    Invariants: ``lengths``, ``rewards`` and ``finish`` share one length (the number
    of completions, >= 1); ``token_ids``, ``logprobs``, ``versions`` (and ``mask``) have
    ``lengths.sum()`` entries.
    """

    lengths: I32
    token_ids: I32
    logprobs: F32
    versions: I32
    rewards: npt.NDArray[np.float64]
    finish: npt.NDArray[np.uint8]
    mask: U8 | None = None

    def completions(self) -> tuple[Completion, ...]:
        ends = np.cumsum(self.lengths).tolist()
        starts = [0, *ends[:-1]]
        m = self.mask
        return tuple(
            Completion(self.token_ids[s:e], self.logprobs[s:e], self.versions[s:e], r, FINISH_REASONS[f],
                       None if m is None else m[s:e])
            for s, e, r, f in zip(starts, ends, self.rewards.tolist(), self.finish.tolist()))


class Group:
    """The completions of one prompt; travels and is stored as one unit.

    The prompt's token ids live here, once: every completion of a group
    continues the same prompt (docs/design.md lists them per completion; storing them
    once per group carries the same information at 1/n of the bytes).

    A group is built either from :class:`Completion` objects or, by the wire
    decoder, from flat :class:`GroupColumns`; then the ``completions`` tuple is
    only materialised when first read (the replay buffer never reads it: it needs
    ids and the oldest version, which the columns give directly).

    Invariants: ``prompt_ids`` is non-empty, stored 1-D contiguous little-endian
    int32 (like a Completion's arrays); at least one completion;
    ``group_id`` is unique across the whole run. Treat instances as immutable.
    """

    __slots__ = ("group_id", "prompt_id", "worker_id", "prompt_ids", "_completions", "_columns", "_oldest")

    def __init__(self, group_id: int, prompt_id: int, worker_id: int, prompt_ids: I32,
                 completions: tuple[Completion, ...]) -> None:
        self.group_id = group_id
        self.prompt_id = prompt_id
        self.worker_id = worker_id
        self.prompt_ids = wire_array(prompt_ids, _I32_LE, "Group.prompt_ids")
        self._completions: tuple[Completion, ...] | None = tuple(completions)
        self._columns: GroupColumns | None = None
        self._oldest: int | None = None

    @classmethod
    def from_columns(cls, group_id: int, prompt_id: int, worker_id: int, prompt_ids: I32,
                     columns: GroupColumns, *, oldest_version: int | None = None) -> "Group":
        """``oldest_version``: the columns' oldest token version when the caller has
        already computed it (the wire decoder does, in its validation pass)."""
        group = cls.__new__(cls)
        group.group_id, group.prompt_id, group.worker_id = group_id, prompt_id, worker_id
        group.prompt_ids = prompt_ids
        group._completions, group._columns, group._oldest = None, columns, oldest_version
        return group

    def __getstate__(self) -> tuple[object, ...]:
        return (self.group_id, self.prompt_id, self.worker_id, self.prompt_ids,
                self._completions if self._columns is None else None, self._columns)

    def __setstate__(self, state: tuple[object, ...]) -> None:
        (self.group_id, self.prompt_id, self.worker_id, self.prompt_ids,  # type: ignore[assignment]
         self._completions, self._columns) = state  # type: ignore[assignment]
        self._oldest = None

    def __repr__(self) -> str:
        return (f"Group(group_id={self.group_id}, prompt_id={self.prompt_id}, worker_id={self.worker_id}, "
                f"n={self.num_completions}, tokens={self.num_tokens})")

    @property
    def completions(self) -> tuple[Completion, ...]:
        if self._completions is None:
            assert self._columns is not None
            self._completions = self._columns.completions()
        return self._completions

    @property
    def columns(self) -> GroupColumns | None:
        """The flat arrays this group was decoded from (None for a group built from completions)."""
        return self._columns

    @property
    def num_completions(self) -> int:
        if self._columns is not None:
            return int(self._columns.lengths.shape[0])
        return len(self.completions)

    @property
    def has_signal(self) -> bool:
        """Whether the completions' rewards differ: a group of equal rewards has zero
        group-relative advantage on every token (it teaches nothing)."""
        r = self.rewards
        return bool(r) and max(r) - min(r) > 1e-9

    @property
    def oldest_version(self) -> int:
        """Oldest version of the group's model tokens (a group without any counts as
        the newest possible, so it is never stale)."""
        if self._oldest is None:  # computed once (the wire decoder passes it in)
            if self._columns is not None:
                m, v = self._columns.mask, self._columns.versions
                v = v if m is None else v[m != 0]
                self._oldest = int(v.min()) if v.size else NEWEST_VERSION
            else:
                versions = [low for c in self.completions if (low := c.min_version) is not None]
                self._oldest = min(versions, default=NEWEST_VERSION)
        return self._oldest

    @property
    def num_tokens(self) -> int:
        if self._columns is not None:
            return int(self._columns.token_ids.shape[0])
        return sum(c.num_tokens for c in self.completions)

    def lag(self, trainer_version: int) -> int:
        """Trainer version minus the oldest token version (docs/design.md section 2)."""
        return max(0, trainer_version - self.oldest_version)

    @property
    def rewards(self) -> list[float]:
        if self._columns is not None:
            return [float(r) for r in self._columns.rewards.tolist()]
        return [c.reward for c in self.completions]
