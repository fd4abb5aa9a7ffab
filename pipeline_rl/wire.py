"""The sample wire format (docs/design.md section 3): one ZeroMQ message = one group.

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

A group with environment tokens (multi-turn episodes) travels as schema version
:data:`SCHEMA_MASKED`: the same fields plus ``mask u1 bytes [sum(lengths)]`` (1 on the
model's tokens). Log-probs and versions are checked, and the oldest version found, on
the model's tokens only; a version 1 message decodes with every token the model's.

Decoding validates everything and raises :class:`WireError` (one line naming
what is wrong) on any problem; it never executes code from the message (no
pickle) and never trusts a length it has not checked.

Cost (8 x 256 tokens, one core): encode ~6 us -- the message is written in one
copy (``_pack``); decode ~7 us -- a message in the encoder's own layout is read
where it lies (``_in_place``: seven zero-copy ``frombuffer`` views into the
message, no msgpack objects, no copy; any other msgpack encoding of the fields is
parsed by msgpack), then one compiled pass (``_wire_kernel.scan_group``) checks
every token and finds the oldest version the buffer needs. A decoded group's
arrays are read-only views that keep the message alive.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from types import ModuleType
from typing import Any
from dataclasses import dataclass

import msgpack
import numpy as np

from pipeline_rl.samples import FINISH_REASONS, Completion, Group, GroupColumns

SCHEMA_VERSION = 1  # written as a msgpack positive fixint: must stay <= 127
SCHEMA_MASKED = 2   # the same fields plus a per-token loss mask (multi-turn episodes)
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_F64 = np.dtype("<f8")
_U8 = np.dtype("u1")
_FINISH_CODE = {name: i for i, name in enumerate(FINISH_REASONS)}
_ID_MAX = 2**63 - 1
_Buffer = bytes | memoryview | np.ndarray  # anything bytes.join takes


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
        return _pack(group, cols.token_ids.shape[0], cols.lengths, [cols.token_ids], [cols.logprobs],
                     [cols.versions], cols.rewards, cols.finish, None if cols.mask is None else [cols.mask])
    comps = group.completions
    if not comps:
        raise WireError("empty_group", f"group {group.group_id} has no completions")
    tokens, logprobs, versions = [c.token_ids for c in comps], [c.logprobs for c in comps], [c.versions for c in comps]
    lengths = list(map(len, tokens))
    masked = any(c.mask is not None for c in comps)   # none (single-turn): schema 1
    if list(map(len, logprobs)) != lengths or list(map(len, versions)) != lengths or (masked and [
            n if c.mask is None else len(c.mask) for c, n in zip(comps, lengths)] != lengths):
        raise WireError("length_mismatch", f"group {group.group_id}: token, logprob, version and "
                        "mask arrays differ in length")
    try:
        finish = bytes([_FINISH_CODE[c.finish_reason] for c in comps])
    except KeyError as e:
        raise WireError("bad_finish_reason", f"unknown finish reason {e.args[0]!r}") from None
    count = len(comps)
    masks = [b"\x01" * n if c.mask is None else c.mask for c, n in zip(comps, lengths)] if masked else None
    # Completion stores its arrays contiguous in the wire dtypes: their bytes go as they are.
    return _pack(group, sum(lengths), struct.pack(f"<{count}i", *lengths), tokens, logprobs, versions,
                 struct.pack(f"<{count}d", *[c.reward for c in comps]), finish, masks)


def _pack(group: Group, num_tokens: int, lengths: _Buffer, tokens: Sequence[_Buffer],
          logprobs: Sequence[_Buffer], versions: Sequence[_Buffer], rewards: _Buffer, finish: _Buffer,
          masks: Sequence[_Buffer] | None) -> bytes:
    """The msgpack array of the module docstring, written directly so that the token
    arrays are copied once, straight into the message: a fixarray header, the
    schema version as a fixint, the three ids as ``uint 64`` (0xcf), then each
    field as ``bin 32`` (0xc6, big-endian byte count, the bytes) -- valid msgpack
    that any decoder reads. Token, log-prob and version fields are the
    concatenation of their parts (``num_tokens`` entries of 4 bytes each);
    ``finish`` holds one byte per completion."""
    prompt = group.prompt_ids  # contiguous <i4 (a Group invariant)
    schema = SCHEMA_VERSION if masks is None else SCHEMA_MASKED
    fields = 4 + len(_LAYOUTS[schema])   # the three ids and the schema, then the arrays
    try:
        head = _HEAD.pack(0x90 | fields, schema, 0xCF, group.group_id, 0xCF, group.prompt_id,
                          0xCF, group.worker_id, 0xC6, prompt.nbytes)
    except struct.error:
        raise WireError("bad_type", f"group {group.group_id}: ids must be integers in 0..2**64-1 "
                        f"(prompt_id {group.prompt_id!r}, worker_id {group.worker_id!r})") from None
    nbytes = 4 * num_tokens
    count = len(finish)
    tok_head = _BIN32.pack(0xC6, nbytes)
    parts: list[Any] = [head, prompt, _BIN32.pack(0xC6, 4 * count), lengths,
                        tok_head, *tokens, tok_head, *logprobs, tok_head, *versions,
                        _BIN32.pack(0xC6, 8 * count), rewards, _BIN32.pack(0xC6, count), finish]
    if masks is not None:
        parts += [_BIN32.pack(0xC6, num_tokens), *masks]
    return b"".join(parts)


_HEAD = struct.Struct(">BBBQBQBQBI")  # fixarray, fixint schema, 3 x (uint 64 tag, id), bin 32 tag + size
_BIN32 = struct.Struct(">BI")          # bin 32 tag + size
_IDS = struct.Struct(_HEAD.format[:-2])  # decoding: the head up to the prompt's bin 32 tag


def _array(buf: object, dtype: np.dtype, what: str) -> np.ndarray:
    if not isinstance(buf, bytes):
        raise WireError("bad_type", f"{what} must be bytes, got {type(buf).__name__}")
    if len(buf) % dtype.itemsize:
        raise WireError("truncated", f"{what} has {len(buf)} bytes, not a multiple of {dtype.itemsize}")
    return np.frombuffer(buf, dtype=dtype)


_ARRAY_LAYOUT: tuple[tuple[np.dtype, str], ...] = (
    (_I32, "prompt_ids"), (_I32, "lengths"), (_I32, "token_ids"), (_F32, "logprobs"),
    (_I32, "versions"), (_F64, "rewards"), (_U8, "finish"))
# schema -> its array fields, in message order after the three ids
_LAYOUTS = {SCHEMA_VERSION: _ARRAY_LAYOUT, SCHEMA_MASKED: (*_ARRAY_LAYOUT, (_U8, "mask"))}
# the encoder's own head (fixarray of the field count, schema) -> (dtype, item size) per array field
_IN_PLACE = {(0x90 | (4 + len(layout)), schema): tuple((d, d.itemsize) for d, _ in layout)
             for schema, layout in _LAYOUTS.items()}

_Fields = tuple[int, int, int, list[np.ndarray]]  # group, prompt and worker id; the arrays


def _in_place(raw: bytes | memoryview) -> _Fields | None:
    """A message in the encoder's own layout (:func:`_pack`), read where it lies: the ids
    and read-only views of the arrays inside ``raw`` -- no copy, no msgpack objects (the
    views keep ``raw`` alive and have whatever alignment their offsets give). None for
    any other layout, valid msgpack or not: :func:`_unpacked` then reads it."""
    size = len(raw)
    if size < _IDS.size:
        return None
    raw = memoryview(raw).toreadonly()  # a ZeroMQ frame's buffer is writable: the arrays must not be
    head, schema, tag1, group_id, tag2, prompt_id, tag3, worker_id = _IDS.unpack_from(raw)
    layout = _IN_PLACE.get((head, schema))
    if layout is None or not tag1 == tag2 == tag3 == 0xCF or group_id | prompt_id | worker_id > _ID_MAX:
        return None
    arrays, at = [], _IDS.size
    try:
        for dtype, itemsize in layout:
            tag, nbytes = _BIN32.unpack_from(raw, at)  # struct.error past the end
            at += 5
            if tag != 0xC6 or nbytes % itemsize:
                return None
            arrays.append(np.frombuffer(raw, dtype, nbytes // itemsize, at))  # ValueError past the end
            at += nbytes
    except (struct.error, ValueError):
        return None
    return (group_id, prompt_id, worker_id, arrays) if at == size else None


def _unpacked(raw: bytes | memoryview, limits: WireLimits) -> _Fields:
    """Any other message: msgpack parses it and each field is checked (WireError names
    the first problem); the arrays are views of the unpacked bytes."""
    try:
        msg = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True,
                              max_bin_len=limits.max_message_bytes, max_array_len=64,
                              max_map_len=0, max_str_len=0, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError("not_msgpack", f"{type(e).__name__}: {e}"[:200]) from None
    if not isinstance(msg, list) or not msg:
        raise WireError("bad_type", f"top level must be a non-empty array, got {type(msg).__name__}")
    layout = _LAYOUTS.get(msg[0]) if type(msg[0]) is int else None
    if layout is None:
        raise WireError("schema_version", f"got {msg[0]!r}, this receiver speaks {SCHEMA_VERSION} and {SCHEMA_MASKED}")
    if len(msg) != 4 + len(layout):
        raise WireError("bad_type", f"expected {4 + len(layout)} fields, got {len(msg)}")
    return (_int_field(msg[1], "group_id"), _int_field(msg[2], "prompt_id"), _int_field(msg[3], "worker_id"),
            [_array(b, dtype, what) for b, (dtype, what) in zip(msg[4:], layout)])


def _int_field(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= _ID_MAX:
        raise WireError("bad_type", f"{what} must be a non-negative integer, got {value!r}")
    return value


def decode_group(raw: bytes | memoryview, limits: WireLimits = DEFAULT_LIMITS) -> Group:
    """Parse and validate one message. Raises WireError naming the first problem.

    The group's arrays may be read-only views of ``raw`` (module docstring): ``raw`` must
    not change afterwards (a received ZeroMQ frame never does)."""
    if len(raw) > limits.max_message_bytes:
        raise WireError("oversized", f"{len(raw)} bytes > limit {limits.max_message_bytes}")
    group_id, prompt_id, worker_id, arrays = _in_place(raw) or _unpacked(raw, limits)
    prompt, lengths, tokens, logprobs, versions, rewards, finish = arrays[:7]
    mask = arrays[7] if len(arrays) > 7 else None
    n = lengths.shape[0]
    if not 1 <= n <= limits.max_completions:
        raise WireError("bad_size", f"{n} completions, allowed 1..{limits.max_completions}")
    if not 1 <= prompt.shape[0] <= limits.max_prompt_tokens:
        raise WireError("bad_size", f"prompt has {prompt.shape[0]} tokens, allowed 1..{limits.max_prompt_tokens}")
    for arr, what in ((rewards, "rewards"), (finish, "finish")):
        if arr.shape[0] != n:
            raise WireError("length_mismatch", f"{what} has {arr.shape[0]} entries, expected {n}")
    kernel = _kernel()
    scan = kernel.scan_group if mask is None else kernel.scan_masked_group  # arguments in the layout's order
    oldest = scan(*arrays, limits.max_completion_tokens, len(FINISH_REASONS))
    if oldest < 0:
        reason, detail = kernel.ERRORS[oldest]
        if reason == "length_mismatch":
            detail += f" ({int(lengths.astype(np.int64).sum())}; got {tokens.shape[0]} token ids, "\
                      f"{logprobs.shape[0]} log-probs, {versions.shape[0]} versions"\
                      f"{'' if mask is None else f', {mask.shape[0]} mask entries'})"
        raise WireError(reason, detail)
    return Group.from_columns(group_id, prompt_id, worker_id, prompt,
                              GroupColumns(lengths, tokens, logprobs, versions, rewards, finish, mask),
                              oldest_version=oldest)


def prepare_decoder() -> None:
    """Load (on a fresh machine: compile, ~2 s) the validator now and decode one tiny
    group, so that the first message a receiver decodes does not pay for it: numba loads
    a kernel's machine code on its first call, not at import (0.10 s measured, which
    otherwise delayed a run's first batch by as much)."""
    _kernel()
    one = np.ones(1, np.int32)
    decode_group(encode_group(Group(0, 0, 0, one, (Completion(one, np.zeros(1, np.float32), one, 0.0, "stop"),))))


@functools.cache
def _kernel() -> ModuleType:
    """The compiled validator's module (numba: imported on the first decode, not at import)."""
    from pipeline_rl import _wire_kernel

    return _wire_kernel
