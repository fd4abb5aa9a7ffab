"""The in-process engine's staging order over a real gloo channel: generation goes on
while an update's bytes arrive (the stall is the swap), and a transfer that fails
half-way leaves the old weights serving."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from staging_helpers import gloo_trainer, send_buckets
from test_engine_inprocess import PROMPTS, TEMPERATURE, model_dirs  # noqa: F401

from pipeline_rl.calls import in_daemon_thread
from pipeline_rl.rollout.engines.engine import EngineConfig, FinishedSequence, GenRequest, SamplingConfig
from pipeline_rl.weight_sync.channels.gloo import GlooUpdateInfo
from pipeline_rl.weight_sync.protocol import tagged
from pipeline_rl.weight_sync.message import WeightUpdateError, load_update

BUCKET = 64 << 10
#: The channel's timeout where the trainer dies half-way: the engine learns of it only when
#: its next receive times out, so the test waits this long (the helper's default is 30 s).
HALF_WAY_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def engine(model_dirs: tuple[Path, Path]) -> Iterator[object]:  # noqa: F811
    from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine

    eng = InprocessEngine(EngineConfig(model_dir=str(model_dirs[0]), max_num_seqs=16, max_model_len=128))
    yield eng
    eng.close()


def _add_short(engine: object, tag: str, count: int) -> None:
    from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine

    assert isinstance(engine, InprocessEngine)
    for i in range(count):
        engine.add(GenRequest(f"{tag}-{i}", tuple(engine.encode(PROMPTS[i % 4])),
                              SamplingConfig(max_new_tokens=4, temperature=TEMPERATURE, ignore_eos=True)))


def test_generation_goes_on_while_the_bytes_arrive(engine: object, model_dirs: tuple) -> None:  # noqa: F811
    from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine

    assert isinstance(engine, InprocessEngine)
    v = engine.version
    update = load_update(model_dirs[1], v + 1)
    channel = gloo_trainer(engine, BUCKET)
    try:
        _add_short(engine, "during", 6)
        engine.start_weight_update()
        receiving = in_daemon_thread(engine.update_weights, tagged(GlooUpdateInfo.of(update)))
        sending = in_daemon_thread(lambda: send_buckets(channel, update, BUCKET, pause_s=2.0))
        finished: list[FinishedSequence] = []
        while not receiving.done():
            finished.extend(engine.step())
        sending.result()
        receiving.result()
    finally:
        channel.close()
    assert len(finished) == 6 and all((f.versions == v).all() for f in finished), \
        "requests did not finish while the bytes were arriving"
    assert engine.load_received(v + 1)     # loaded into the shadow, beside generation
    applied = engine.apply_staged()
    assert applied is not None and applied.version == v + 1 and engine.version == v + 1
    assert applied.stall_s < applied.load_s         # the stall is the swap, not the load


def test_a_transfer_failing_half_way_leaves_the_old_weights_serving(engine: object,
                                                                      model_dirs: tuple) -> None:  # noqa: F811
    from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine

    assert isinstance(engine, InprocessEngine)
    v = engine.version
    update = load_update(model_dirs[0], v + 1)
    channel = gloo_trainer(engine, BUCKET, timeout_s=HALF_WAY_TIMEOUT_S)
    engine.start_weight_update()
    receiving = in_daemon_thread(engine.update_weights, tagged(GlooUpdateInfo.of(update)))
    send_buckets(channel, update, BUCKET, stop_after=2)
    with pytest.raises(WeightUpdateError, match="^weights not received: ") as info:
        receiving.result(timeout=60)
    assert "\n" not in str(info.value)
    assert engine.apply_staged() is None and engine.version == v
    _add_short(engine, "after", 4)
    done: list[FinishedSequence] = []
    while engine.num_unfinished():
        done.extend(engine.step())
    assert len(done) == 4 and all((f.versions == v).all() for f in done)
