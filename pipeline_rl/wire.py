"""The sample wire format (DESIGN.md section 3): one ZeroMQ message = one group.

Layout: a msgpack array, schema version first. Token arrays travel as raw
little-endian bytes, concatenated over the group's completions, with a per-
completion length array to split them (one buffer per array kind keeps encode
and decode to a handful of numpy calls per group instead of a few per token
list)::

    [SCHEMA_VERSION, group_id, prompt_id, worker_id,
     prompt_ids   <i4 bytes [P],
     lengths      <i4 bytes [n],          completion lengths
     token_ids    <i4 bytes [sum(lengths)],
     logprobs     <f4 bytes [sum(lengths)],   behaviour log-probs after temperature
     versions     <i4 bytes [sum(lengths)],   policy version per token
     rewards      <f8 bytes [n],
     finish       u1  bytes [n]]              index into FINISH_REASONS

Decoding validates everything and raises :class:`WireError` (one line naming
what is wrong) on any problem; it never executes code from the message (no
pickle) and never trusts a length it has not checked.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import msgpack
import numpy as np

from pipeline_rl.samples import FINISH_REASONS, Group, GroupColumns

SCHEMA_VERSION = 1
_FIELDS = 11
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_F64 = np.dtype("<f8")
_U8 = np.dtype("u1")
_FINISH_CODE = {name: i for i, name in enumerate(FINISH_REASONS)}
_ID_MAX = 2**63 - 1


class WireError(ValueError):
    """A message that is not a valid encoded group. ``reason`` is a short
    machine-readable tag for counting; ``str(err)`` is one human line."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class WireLimits:
    """Upper bounds a decoder enforces before allocating anything."""

    max_message_bytes: int = 64 * 2**20
    max_completions: int = 4096
    max_prompt_tokens: int = 1 << 20
    max_completion_tokens: int = 1 << 20


DEFAULT_LIMITS = WireLimits()


def encode_group(group: Group) -> bytes:
    """Serialise a group. Raises WireError if the group breaks its own invariants."""
    cols = group.columns
    if cols is not None:  # decoded earlier: the flat arrays are already the wire layout
        return _pack(group, cols.lengths.tobytes(), cols.token_ids.tobytes(), cols.logprobs.tobytes(),
                     cols.versions.tobytes(), cols.rewards.tobytes(), cols.finish.tobytes())
    comps = group.completions
    if not comps:
        raise WireError("empty_group", f"group {group.group_id} has no completions")
    lengths = np.fromiter((c.token_ids.shape[0] for c in comps), dtype=_I32, count=len(comps))
    for c in comps:
        n = c.token_ids.shape[0]
        if c.logprobs.shape[0] != n or c.versions.shape[0] != n:
            raise WireError("length_mismatch", f"group {group.group_id}: token, logprob and "
                            "version arrays differ in length")
    try:
        finish = bytes(_FINISH_CODE[c.finish_reason] for c in comps)
    except KeyError as e:
        raise WireError("bad_finish_reason", f"unknown finish reason {e.args[0]!r}") from None
    return _pack(group, lengths.tobytes(), _cat([c.token_ids for c in comps], _I32),
                 _cat([c.logprobs for c in comps], _F32), _cat([c.versions for c in comps], _I32),
                 np.fromiter((c.reward for c in comps), dtype=_F64, count=len(comps)).tobytes(), finish)


def _pack(group: Group, lengths: bytes, tokens: bytes, logprobs: bytes, versions: bytes,
          rewards: bytes, finish: bytes) -> bytes:
    return msgpack.packb([
        SCHEMA_VERSION, group.group_id, group.prompt_id, group.worker_id,
        np.ascontiguousarray(group.prompt_ids, dtype=_I32).tobytes(),
        lengths, tokens, logprobs, versions, rewards, finish,
    ], use_bin_type=True)


def _cat(arrays: list[np.ndarray], dtype: np.dtype) -> bytes:
    return np.concatenate(arrays).astype(dtype, copy=False).tobytes()


def _array(buf: object, dtype: np.dtype, what: str, count: int | None = None) -> np.ndarray:
    if not isinstance(buf, bytes):
        raise WireError("bad_type", f"{what} must be bytes, got {type(buf).__name__}")
    if len(buf) % dtype.itemsize:
        raise WireError("truncated", f"{what} has {len(buf)} bytes, not a multiple of {dtype.itemsize}")
    arr = np.frombuffer(buf, dtype=dtype)
    if count is not None and arr.shape[0] != count:
        raise WireError("length_mismatch", f"{what} has {arr.shape[0]} entries, expected {count}")
    return arr


def _int_field(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= _ID_MAX:
        raise WireError("bad_type", f"{what} must be a non-negative integer, got {value!r}")
    return value


def decode_group(raw: bytes | memoryview, limits: WireLimits = DEFAULT_LIMITS) -> Group:
    """Parse and validate one message. Raises WireError naming the first problem."""
    if len(raw) > limits.max_message_bytes:
        raise WireError("oversized", f"{len(raw)} bytes > limit {limits.max_message_bytes}")
    try:
        msg = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True,
                              max_bin_len=limits.max_message_bytes, max_array_len=64,
                              max_map_len=0, max_str_len=0, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError("not_msgpack", f"{type(e).__name__}: {e}"[:200]) from None
    if not isinstance(msg, list) or not msg:
        raise WireError("bad_type", f"top level must be a non-empty array, got {type(msg).__name__}")
    if msg[0] != SCHEMA_VERSION or type(msg[0]) is not int:
        raise WireError("schema_version", f"got {msg[0]!r}, this receiver speaks {SCHEMA_VERSION}")
    if len(msg) != _FIELDS:
        raise WireError("bad_type", f"expected {_FIELDS} fields, got {len(msg)}")
    group_id = _int_field(msg[1], "group_id")
    prompt_id = _int_field(msg[2], "prompt_id")
    worker_id = _int_field(msg[3], "worker_id")
    prompt = _array(msg[4], _I32, "prompt_ids")
    lengths = _array(msg[5], _I32, "lengths")
    n = lengths.shape[0]
    if not 1 <= n <= limits.max_completions:
        raise WireError("bad_size", f"{n} completions, allowed 1..{limits.max_completions}")
    if not 1 <= prompt.shape[0] <= limits.max_prompt_tokens:
        raise WireError("bad_size", f"prompt has {prompt.shape[0]} tokens, allowed 1..{limits.max_prompt_tokens}")
    lens = lengths.tolist()
    if min(lens) < 0 or max(lens) > limits.max_completion_tokens:
        raise WireError("bad_size", f"completion lengths outside 0..{limits.max_completion_tokens}")
    total = sum(lens)
    tokens = _array(msg[6], _I32, "token_ids", total)
    logprobs = _array(msg[7], _F32, "logprobs", total)
    versions = _array(msg[8], _I32, "versions", total)
    rewards = _array(msg[9], _F64, "rewards", n)
    finish = _array(msg[10], _U8, "finish", n)
    if not np.isfinite(rewards).all():
        raise WireError("bad_value", f"non-finite reward in {rewards.tolist()}")
    if int(finish.max()) >= len(FINISH_REASONS):
        raise WireError("bad_value", f"finish code {int(finish.max())} unknown")
    ends = list(itertools.accumulate(lens))
    _check_tokens(prompt, tokens, logprobs, versions, ends)
    return Group.from_columns(group_id, prompt_id, worker_id, prompt,
                              GroupColumns(lengths, tokens, logprobs, versions, rewards, finish))


def _check_tokens(prompt: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray,
                  versions: np.ndarray, ends: list[int]) -> None:
    """Token ids and versions >= 0, log-probs <= 0 (not NaN), versions non-decreasing
    within each completion (they may drop from one completion to the next)."""
    if prompt.min() < 0:
        raise WireError("bad_value", "negative token id")
    if not tokens.size:
        return
    if min(tokens.min(), versions.min()) < 0:
        raise WireError("bad_value", "negative token id or policy version")
    if not logprobs.max() <= 1e-3:  # max is NaN if any entry is: also rejected
        raise WireError("bad_value", "log-probs must be <= 0 and not NaN")
    drops = versions[1:] < versions[:-1]  # drops[i]: v[i+1] < v[i]
    if drops.any():
        drops[[e - 1 for e in ends[:-1] if 0 < e < versions.size]] = False  # completion boundaries
        if drops.any():
            raise WireError("bad_value", "token versions decrease within a completion")
