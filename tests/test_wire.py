"""The sample wire format: round trips (property-based) and rejection of bad messages."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline_rl.samples import FINISH_REASONS, Completion, Group
from pipeline_rl.wire import SCHEMA_VERSION, WireError, WireLimits, decode_group, encode_group


@st.composite
def groups(draw: st.DrawFn) -> Group:
    n = draw(st.integers(1, 6))
    comps = []
    for _ in range(n):
        length = draw(st.integers(0, 20))
        start = draw(st.integers(0, 5))
        steps = draw(st.lists(st.integers(0, 1), min_size=length, max_size=length))
        versions = np.asarray(np.cumsum([start] + steps)[:length], dtype=np.int32)
        comps.append(Completion(
            token_ids=np.asarray(draw(st.lists(st.integers(0, 2**31 - 1), min_size=length,
                                               max_size=length)), dtype=np.int32),
            logprobs=np.asarray(draw(st.lists(st.floats(-50.0, 0.0, width=32), min_size=length,
                                              max_size=length)), dtype=np.float32),
            versions=versions,
            reward=draw(st.floats(allow_nan=False, allow_infinity=False)),
            finish_reason=draw(st.sampled_from(FINISH_REASONS))))
    prompt = np.asarray(draw(st.lists(st.integers(0, 1000), min_size=1, max_size=10)), dtype=np.int32)
    return Group(draw(st.integers(0, 2**63 - 1)), draw(st.integers(0, 2**40)), draw(st.integers(0, 99)),
                 prompt, tuple(comps))


@settings(max_examples=200, deadline=None)
@given(groups())
def test_round_trip(group: Group) -> None:
    back = decode_group(encode_group(group))
    assert (back.group_id, back.prompt_id, back.worker_id) == (group.group_id, group.prompt_id, group.worker_id)
    np.testing.assert_array_equal(back.prompt_ids, group.prompt_ids)
    assert len(back.completions) == len(group.completions)
    for a, b in zip(back.completions, group.completions):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        np.testing.assert_array_equal(a.versions, b.versions)
        assert a.reward == b.reward and a.finish_reason == b.finish_reason
        assert a.token_ids.dtype == np.int32 and a.logprobs.dtype == np.float32


def _group(**over: object) -> Group:
    comp = Completion(np.array([5, 6, 7], np.int32), np.array([-0.1, -0.2, -0.3], np.float32),
                      np.array([1, 1, 2], np.int32), 1.0, "stop")
    fields: dict[str, object] = dict(group_id=1, prompt_id=2, worker_id=0,
                                     prompt_ids=np.array([1, 2], np.int32), completions=(comp, comp))
    fields.update(over)
    return Group(**fields)  # type: ignore[arg-type]


def _fields() -> list[object]:
    return list(msgpack.unpackb(encode_group(_group()), raw=False))


def _bad(index: int, value: object) -> bytes:
    f = _fields()
    f[index] = value
    return msgpack.packb(f, use_bin_type=True)


@pytest.mark.parametrize("raw, reason", [
    (b"", "not_msgpack"),
    (b"\xc1\xc1garbage", "not_msgpack"),
    (msgpack.packb({"a": 1}), "not_msgpack"),  # maps are refused by the parser,
    (msgpack.packb([]), "bad_type"),
    (_bad(0, 99), "schema_version"),
    (_bad(0, "1"), "not_msgpack"),  # strings are refused by the parser,
    (msgpack.packb(_fields()[:-1], use_bin_type=True), "bad_type"),
    (_bad(1, -1), "bad_type"),
    (_bad(2, 2.5), "bad_type"),
    (_bad(4, [1, 2]), "bad_type"),
    (_bad(6, b"\x00" * 7), "truncated"),
    (_bad(6, b"\x00" * 8), "length_mismatch"),
    (_bad(7, np.array([-0.1] * 5, "<f4").tobytes()), "length_mismatch"),
    (_bad(8, np.array([1] * 7, "<i4").tobytes()), "length_mismatch"),
    (_bad(4, np.array([1, -2], "<i4").tobytes()), "bad_value"),
    (_bad(9, np.array([1.0], "<f8").tobytes()), "length_mismatch"),
    (_bad(9, np.array([math.nan, 1.0], "<f8").tobytes()), "bad_value"),
    (_bad(9, np.array([math.inf, 1.0], "<f8").tobytes()), "bad_value"),
    (_bad(7, np.array([0.5] * 6, "<f4").tobytes()), "bad_value"),
    (_bad(7, np.array([math.nan] * 6, "<f4").tobytes()), "bad_value"),
    (_bad(8, np.array([2, 1, 1, 1, 1, 1], "<i4").tobytes()), "bad_value"),
    (_bad(8, np.array([-1, 1, 1, 1, 1, 1], "<i4").tobytes()), "bad_value"),
    (_bad(6, np.array([5, -6, 7, 5, 6, 7], "<i4").tobytes()), "bad_value"),
    (_bad(10, b"\x00\x09"), "bad_value"),
    (_bad(5, np.array([], "<i4").tobytes()), "bad_size"),
    (_bad(4, b""), "bad_size"),
    (_bad(5, np.array([3, -3], "<i4").tobytes()), "bad_size"),
])
def test_bad_messages_are_rejected_with_a_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(WireError) as err:
        decode_group(raw)
    assert err.value.reason == reason
    assert "\n" not in str(err.value)


def test_oversized_message_is_rejected_before_parsing() -> None:
    raw = encode_group(_group())
    with pytest.raises(WireError, match="oversized"):
        decode_group(raw, WireLimits(max_message_bytes=len(raw) - 1))


def test_truncated_message_never_decodes() -> None:
    raw = encode_group(_group())
    for cut in range(len(raw)):
        with pytest.raises(WireError):
            decode_group(raw[:cut])


def test_random_garbage_never_crashes() -> None:
    rng = np.random.default_rng(0)
    raw = bytearray(encode_group(_group()))
    for _ in range(2000):
        mutated = bytearray(raw)
        for pos in rng.integers(0, len(raw), size=3):
            mutated[pos] = int(rng.integers(0, 256))
        try:
            decode_group(bytes(mutated))
        except WireError:
            pass


def test_versions_may_drop_between_completions() -> None:
    hi = Completion(np.array([1], np.int32), np.array([-1.0], np.float32), np.array([9], np.int32), 0.0, "length")
    lo = Completion(np.array([1], np.int32), np.array([-1.0], np.float32), np.array([3], np.int32), 0.0, "length")
    back = decode_group(encode_group(_group(completions=(hi, lo))))
    assert back.oldest_version == 3 and back.lag(5) == 2


def test_no_pickle_on_the_wire() -> None:
    raw = encode_group(_group())
    assert b"\x80\x04" not in raw[:2] and b"numpy" not in raw


def test_encoder_rejects_inconsistent_groups() -> None:
    bad = Completion(np.array([1, 2], np.int32), np.array([-1.0], np.float32), np.array([0, 0], np.int32), 0.0, "stop")
    with pytest.raises(WireError, match="length_mismatch"):
        encode_group(_group(completions=(bad,)))
    with pytest.raises(WireError, match="empty_group"):
        encode_group(_group(completions=()))


def test_completion_stores_wire_dtypes() -> None:
    comp = Completion([5, 6], np.array([-0.5, -0.25]), np.array([1, 2], np.int64), 0.0, "stop")  # type: ignore[arg-type]
    assert comp.token_ids.dtype == np.int32 and comp.logprobs.dtype == np.float32
    assert comp.versions.dtype == np.int32 and comp.versions.flags.c_contiguous
    strided = np.arange(8, dtype=np.int32)[::2]
    assert Completion(strided, np.zeros(4, np.float32), np.zeros(4, np.int32), 0.0, "stop").token_ids.flags.c_contiguous
    with pytest.raises(ValueError, match="token_ids must be 1-D"):
        Completion(np.zeros((2, 2), np.int32), np.zeros(4, np.float32), np.zeros(4, np.int32), 0.0, "stop")


def test_message_is_plain_msgpack_with_the_documented_fields() -> None:
    group = _group()
    fields = msgpack.unpackb(encode_group(group), raw=False)
    assert fields[:4] == [SCHEMA_VERSION, 1, 2, 0] and len(fields) == 11
    assert np.frombuffer(fields[6], "<i4").tolist() == [5, 6, 7, 5, 6, 7]
    assert np.frombuffer(fields[8], "<i4").tolist() == [1, 1, 2, 1, 1, 2]
    # a decoded group re-encodes to the same bytes (the columns path of the encoder)
    assert encode_group(decode_group(encode_group(group))) == encode_group(group)


def _reference_ok(lengths: list[int], versions: np.ndarray, logprobs: np.ndarray) -> bool:
    """The version and log-prob rules, written the slow and obvious way."""
    pos = 0
    for n in lengths:
        v = versions[pos:pos + n]
        if (np.diff(v) < 0).any():
            return False
        pos += n
    return bool((versions >= 0).all() and (logprobs <= np.float32(1e-3)).all())


def test_validator_matches_a_reference_on_random_groups() -> None:
    """The compiled validator (branch-free reductions, boundary drops subtracted)
    accepts exactly what the per-completion reference accepts."""
    rng = np.random.default_rng(1)
    for _ in range(400):
        lengths = [int(x) for x in rng.integers(0, 5, size=int(rng.integers(1, 5)))]
        total = sum(lengths)
        versions = np.sort(rng.integers(0, 4, size=total)).astype(np.int32)[::-1].copy() \
            if rng.random() < 0.3 else rng.integers(-1 if rng.random() < 0.1 else 0, 4, size=total).astype(np.int32)
        logprobs = -rng.exponential(1.0, size=total).astype(np.float32)
        if total and rng.random() < 0.1:
            logprobs[int(rng.integers(0, total))] = rng.choice([np.nan, 0.5])
        fields = _fields()
        fields[5] = np.array(lengths, "<i4").tobytes()
        fields[6] = np.zeros(total, "<i4").tobytes()
        fields[7] = logprobs.astype("<f4").tobytes()
        fields[8] = versions.astype("<i4").tobytes()
        fields[9] = np.zeros(len(lengths), "<f8").tobytes()
        fields[10] = bytes(len(lengths))
        raw = msgpack.packb(fields, use_bin_type=True)
        expected = _reference_ok(lengths, versions, logprobs)
        try:
            group = decode_group(raw)
        except WireError as e:
            assert not expected and e.reason == "bad_value", (lengths, versions, logprobs, e)
            continue
        assert expected, (lengths, versions, logprobs)
        firsts = [int(versions[s]) for s, n in zip(np.cumsum([0] + lengths[:-1]), lengths) if n]
        assert group.oldest_version == (min(firsts) if firsts else 2**31 - 1)


def test_encoder_rejects_ids_outside_uint64() -> None:
    with pytest.raises(WireError, match="bad_type: group -1: ids must be integers"):
        encode_group(_group(group_id=-1))


def test_prepare_decoder_loads_the_validators_machine_code_before_the_first_message() -> None:
    """In a fresh process: after ``prepare_decoder`` the validator already has a compiled
    signature, so a receiver's first message does not wait for numba to load it."""
    import subprocess
    import sys

    code = ("from pipeline_rl.wire import _kernel, prepare_decoder; prepare_decoder(); "
            "print(len(_kernel().scan_group.signatures))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert int(out.stdout.strip().splitlines()[-1]) >= 1
