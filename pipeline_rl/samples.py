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

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "abort")

I32 = npt.NDArray[np.int32]
F32 = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True, eq=False)
class Completion:
    """One sampled completion of a prompt.

    Invariants: ``token_ids``, ``logprobs`` and ``versions`` share one length
    (the completion length, possibly 0); ``logprobs``
    are the behaviour log-probs of the sampled tokens after temperature (<= 0,
    may be ``-inf`` only if the sampler produced an impossible token);
    ``versions[t]`` is the policy version of the weights that produced token t,
    non-decreasing along the sequence; ``reward`` is finite.
    """

    token_ids: I32
    logprobs: F32
    versions: I32
    reward: float
    finish_reason: FinishReason

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def min_version(self) -> int | None:
        return int(self.versions.min()) if self.versions.size else None

    @property
    def num_versions(self) -> int:
        """How many distinct policy versions produced this completion's tokens."""
        return int(np.unique(self.versions).size)


@dataclass(frozen=True, slots=True, eq=False)
class Group:
    """The completions of one prompt; travels and is stored as one unit.

    The prompt's token ids live here, once: every completion of a group
    continues the same prompt (DESIGN.md lists them per completion; storing them
    once per group carries the same information at 1/n of the bytes).

    Invariants: ``prompt_ids`` is non-empty; at least one completion;
    ``group_id`` is unique across the whole run.
    """

    group_id: int
    prompt_id: int
    worker_id: int
    prompt_ids: I32
    completions: tuple[Completion, ...]

    @property
    def oldest_version(self) -> int:
        """Oldest token version in the group (a group with no tokens counts as
        the newest possible, so it is never stale)."""
        versions = [c.min_version for c in self.completions if c.num_tokens]
        return min(v for v in versions if v is not None) if versions else np.iinfo(np.int32).max

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.completions)

    def lag(self, trainer_version: int) -> int:
        """Trainer version minus the oldest token version (DESIGN.md section 2)."""
        return max(0, trainer_version - self.oldest_version)

    @property
    def rewards(self) -> list[float]:
        return [c.reward for c in self.completions]
