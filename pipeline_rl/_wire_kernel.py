"""The numba validator behind ``wire.decode_group`` (imported lazily: importing
numba costs ~0.5 s; compiled once per machine into numba's on-disk cache).

One call over a decoded group's flat arrays checks every per-token invariant
and finds the oldest token version, in ~1 us for 8 x 256 tokens (most of it
numba's argument dispatch); the numpy version of the same checks took ~15 us
(some twenty small array calls), which made the receiver the bottleneck of the
sample link.

``scan_group`` returns the group's oldest token version (``>= 0``; ``NEWEST``
for a group with no tokens) or a negative code from :data:`ERRORS`. It reads
``tokens``, ``logprobs`` and ``versions`` only after checking that all three
hold ``sum(lengths)`` entries, so it never reads out of bounds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, types

from pipeline_rl.samples import NEWEST_VERSION as NEWEST  # a group without tokens: never stale

# One signature per kernel: the decoder's arrays are read-only views of a message at any
# alignment (``wire._in_place``), aligned or not field by field. Typed as read-only and
# unaligned, every such mix (and any writable or aligned array) converts to the one
# compiled version, instead of numba compiling one per combination of alignments.
_I4, _F4, _F8, _U1 = (types.Array(t, 1, "C", readonly=True, aligned=False)
                      for t in (types.int32, types.float32, types.float64, types.uint8))
_SCAN = types.int64(_I4, _I4, _I4, _F4, _I4, _F8, _U1, types.int64, types.int64)
_SCAN_MASKED = types.int64(_I4, _I4, _I4, _F4, _I4, _F8, _U1, _U1, types.int64, types.int64)


# code -> (reason, one-line detail); reasons match wire.WireError's tags
ERRORS: dict[int, tuple[str, str]] = {
    -1: ("bad_size", "a completion length is negative or above the limit"),
    -2: ("length_mismatch", "token_ids do not hold sum(lengths) entries"),
    -3: ("length_mismatch", "logprobs do not hold sum(lengths) entries"),
    -4: ("length_mismatch", "versions do not hold sum(lengths) entries"),
    -5: ("bad_value", "negative prompt token id"),
    -6: ("bad_value", "negative token id"),
    -7: ("bad_value", "negative policy version"),
    -8: ("bad_value", "token versions decrease within a completion"),
    -9: ("bad_value", "log-probs must be <= 0 and not NaN"),
    -10: ("bad_value", "non-finite reward"),
    -11: ("bad_value", "unknown finish code"),
    -12: ("length_mismatch", "mask does not hold sum(lengths) entries"),
    -13: ("bad_value", "mask values must be 0 or 1"),
}

_LOGP_SLACK = np.float32(1e-3)  # float32 rounding of a log-prob of ~0 may land just above 0


@njit(inline="always")
def _min_i32(a: np.ndarray) -> Any:  # pragma: no cover - compiled
    m = np.int32(0)
    for i in range(a.shape[0]):
        x = a[i]
        m = x if x < m else m
    return m


@njit(inline="always")
def _sizes(prompt: np.ndarray, lengths: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray,
           versions: np.ndarray, max_length: int) -> Any:  # pragma: no cover - compiled
    """sum(lengths), or the code (< 0) of the first problem with the completion lengths,
    the per-token array sizes or the (prompt and completion) token ids."""
    total = 0
    for c in range(lengths.shape[0]):
        if lengths[c] < 0 or lengths[c] > max_length:
            return -1
        total += lengths[c]
    if tokens.shape[0] != total:
        return -2
    if logprobs.shape[0] != total:
        return -3
    if versions.shape[0] != total:
        return -4
    if _min_i32(prompt) < 0:
        return -5
    if _min_i32(tokens) < 0:
        return -6
    return total


@njit(inline="always")
def _completion(rewards: np.ndarray, finish: np.ndarray, c: int, num_finish: int) -> Any:  # pragma: no cover
    """0, or the code of completion ``c``'s problem with its reward or finish code."""
    if not np.isfinite(rewards[c]):
        return -10
    if finish[c] >= num_finish:
        return -11
    return 0


@njit(_SCAN, cache=True, nogil=True, boundscheck=False)
def scan_group(prompt: np.ndarray, lengths: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray,
               versions: np.ndarray, rewards: np.ndarray, finish: np.ndarray,
               max_length: int, num_finish: int) -> int:  # pragma: no cover - compiled
    """Validate one group (shapes: lengths/rewards/finish [n], the rest [sum(lengths)],
    prompt [P]); see the module docstring for the result.

    The per-token checks are branch-free reductions over whole arrays (min, a
    count of bad log-probs, a count of version drops) so that they vectorise:
    ~0.4 us for 2048 tokens where an early-exit loop took ~2 us. A drop at a
    completion boundary is allowed, so those are subtracted from the count."""
    total = _sizes(prompt, lengths, tokens, logprobs, versions, max_length)
    if total < 0:
        return total
    if _min_i32(versions) < 0:
        return -7
    drops = np.int32(0)
    for t in range(1, total):
        drops += np.int32(versions[t] < versions[t - 1])
    bad = np.int32(0)
    for t in range(total):
        bad += np.int32(not logprobs[t] <= _LOGP_SLACK)  # NaN fails this too
    oldest = NEWEST
    start = 0
    for c in range(lengths.shape[0]):
        if lengths[c] > 0:
            oldest = min(oldest, versions[start])
            if start > 0 and versions[start] < versions[start - 1]:
                drops -= 1  # between two completions: allowed
        start += lengths[c]
        err = _completion(rewards, finish, c, num_finish)
        if err:
            return err
    if drops:
        return -8
    if bad:
        return -9
    return oldest


@njit(_SCAN_MASKED, cache=True, nogil=True, boundscheck=False)
def scan_masked_group(prompt: np.ndarray, lengths: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray,
                      versions: np.ndarray, rewards: np.ndarray, finish: np.ndarray, mask: np.ndarray,
                      max_length: int, num_finish: int) -> int:  # pragma: no cover - compiled
    """:func:`scan_group` for a group with a loss mask (multi-turn episodes): log-probs,
    versions (non-negative, non-decreasing within a completion) and the oldest version
    are checked and found on the model's tokens (``mask == 1``) only; token ids and
    the mask itself everywhere."""
    total = _sizes(prompt, lengths, tokens, logprobs, versions, max_length)
    if total < 0:
        return total
    if mask.shape[0] != total:
        return -12
    oldest = NEWEST
    start = 0
    for c in range(lengths.shape[0]):
        last = -1
        for t in range(start, start + lengths[c]):
            if mask[t] > 1:
                return -13
            if mask[t] == 0:
                continue
            if versions[t] < 0:
                return -7
            if versions[t] < last:
                return -8
            if not logprobs[t] <= _LOGP_SLACK:
                return -9
            last = versions[t]
            oldest = min(oldest, versions[t])
        start += lengths[c]
        err = _completion(rewards, finish, c, num_finish)
        if err:
            return err
    return oldest
