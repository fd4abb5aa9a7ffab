"""The CPU weight-transfer backend's wire (``pipeline_rl.weight_sync.channels.gloo``): bucket
cuts, a real gloo channel between two threads and between Ray actors, bad metadata
refused in one line, a dead or failing worker that never hangs the trainer and gets
the newest weights on its next channel."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pipeline_rl.weight_sync.publish.publisher import WeightPublisher
from pipeline_rl.weight_sync.channels.gloo import GlooTrainerChannel, GlooUpdateInfo, bucket_plan
from pipeline_rl.weight_sync.protocol import OpenContext
from pipeline_rl.weight_sync.message import WeightUpdate, WeightUpdateError
from staging_helpers import ThreadClient


def _update(version: int, scale: float = 1.0) -> WeightUpdate:
    rng = np.random.default_rng(version)
    shapes = [(300, 64), (64,), (7, 3), (2048, 256), (5,)]
    arrays = tuple((scale * rng.standard_normal(s)).astype(np.float32) for s in shapes)
    return WeightUpdate(version, tuple(f"p{i}" for i in range(len(shapes))), arrays)


def test_bucket_plan_cuts_in_order_within_the_bound() -> None:
    sizes = [10, 20, 5, 100, 1, 1, 30]
    buckets = bucket_plan(sizes, 32)
    assert [list(b) for b in buckets] == [[0, 1], [2], [3], [4, 5, 6]]
    assert [i for b in buckets for i in b] == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= 32 or len(b) == 1 for b in buckets)
    assert bucket_plan([], 32) == []


def test_update_info_refuses_bad_metadata_in_one_line() -> None:
    with pytest.raises(WeightUpdateError, match="differ in length"):
        GlooUpdateInfo(1, ["a", "b"], ["float32"], [[1], [2]])
    with pytest.raises(WeightUpdateError, match="'int8' not accepted"):
        GlooUpdateInfo(1, ["a"], ["int8"], [[1]])


def test_channel_moves_exact_bytes_in_small_buckets() -> None:
    client = ThreadClient()
    sender = GlooTrainerChannel.open(client, OpenContext(bucket_bytes=64 << 10))
    try:
        for v in (1, 2):
            timing = sender.send(_update(v))
            assert timing.version == v and timing.num_bytes == _update(v).num_bytes
        assert client.finished == ["1", "2"]
        for sent, got in zip((_update(1), _update(2)), client.got):
            assert got.version == sent.version and got.names == sent.names
            assert all(np.array_equal(a, b) for a, b in zip(sent.arrays, got.arrays))
    finally:
        sender.close()


def test_a_refused_update_surfaces_and_the_channel_stays_aligned() -> None:
    client = ThreadClient(fail_once=True)
    sender = GlooTrainerChannel.open(client, OpenContext())
    try:
        with pytest.raises(WeightUpdateError, match="refused once"):
            sender.send(_update(1))
        sender.send(_update(2))       # the refused update was drained: the next one arrives whole
        assert [u.version for u in client.got] == [2] and client.finished == ["2"]
        assert np.array_equal(client.got[0].arrays[3], _update(2).arrays[3])
    finally:
        sender.close()


def test_non_finite_values_are_named_after_the_whole_update_drained() -> None:
    client = ThreadClient()
    sender = GlooTrainerChannel.open(client, OpenContext(bucket_bytes=64 << 10))
    try:
        bad = _update(1)
        bad.arrays[3][7, 7] = np.nan                  # in a middle bucket: later buckets still follow
        with pytest.raises(WeightUpdateError, match="^p3: non-finite values$"):
            sender.send(bad)
        sender.send(_update(2))
        assert [u.version for u in client.got] == [2]
    finally:
        sender.close()


def test_publisher_vllm_transport_reopens_a_failed_workers_channel() -> None:
    good, flaky = ThreadClient(), ThreadClient(fail_once=True)
    pub = WeightPublisher([good, flaky], background=False, path="gloo")
    try:
        pub.publish(_update(1))
        assert pub.stats().offer_failures == 1            # counted, never raised
        pub.publish(_update(2))                           # a new channel, the newest weights
        assert [u.version for u in good.got] == [1, 2] and [u.version for u in flaky.got] == [2]
        assert len(pub.send_timings) == 3
        assert [v for v, _ in pub.stats().published_at] == [1, 2]
    finally:
        pub.close()


# ------------------------------------------------------------------------------ across Ray actors

class ActorReceiver(ThreadClient):
    def versions(self) -> list[tuple[int, float]]:
        return [(u.version, float(u.arrays[0].sum())) for u in self.got]

    def die(self) -> None:
        import os

        os._exit(1)


def test_publisher_sends_to_ray_actors_and_survives_a_dead_one(ray_local: None) -> None:
    import sys

    import ray
    from ray import cloudpickle

    import staging_helpers

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cloudpickle.register_pickle_by_value(staging_helpers)   # its ThreadClient is the base class
    actor = ray.remote(num_cpus=0.1, max_concurrency=4)(ActorReceiver)
    workers = [actor.remote(), actor.remote()]
    pub = WeightPublisher(workers)
    try:
        for v in (1, 2):
            pub.publish(_update(v))
            assert pub.flush(60)
        expect = [(v, float(_update(v).arrays[0].sum())) for v in (1, 2)]
        assert [ray.get(w.versions.remote()) for w in workers] == [expect, expect]
        dead = actor.remote()
        ray.get(dead.versions.remote())
        dead.die.remote()
        time.sleep(0.5)
        pub.set_workers(workers + [dead])
        t = time.perf_counter()
        pub.publish(_update(3))
        assert pub.flush(60)
        assert time.perf_counter() - t < 30                          # failed fast, no hang
        assert pub.stats().offer_failures >= 1
        assert ray.get(workers[0].versions.remote())[-1][0] == 3
    finally:
        pub.close()
