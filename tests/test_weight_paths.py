"""Weights on the wire in the served dtype, the shared-memory path and path choice
(``pipeline_rl.weight_sync``): bfloat16 bit-exact from the trainer's parameters to the
worker's tensors on both CPU paths, non-finite bfloat16 refused, the automatic and
forced path per placement, and a transfer whose peer dies ending within its timeout
with one line."""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np
import pytest
import torch

from pipeline_rl.weight_sync.dtypes import to_torch
from pipeline_rl.weight_sync.channels.gloo import GlooTrainerChannel
from pipeline_rl.weight_sync.protocol import OpenContext
from pipeline_rl.weight_sync.layout import contiguous_bytes
from pipeline_rl.weight_sync.message import WeightSpec, WeightUpdate, WeightUpdateError, validate_update
from pipeline_rl.weight_sync.channels.paths import PathError, Placement, choose_path
from pipeline_rl.weight_sync.publish.gather import gather_weights
from pipeline_rl.weight_sync.publish.publisher import WeightPublisher
from pipeline_rl.weight_sync.channels.shm import SegmentReader, SharedWriter, ShmUpdateInfo, gathered_in
from staging_helpers import ShmClient, ThreadClient


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(97, 48), torch.nn.Linear(48, 200), torch.nn.LayerNorm(200))


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_gather_casts_to_bf16_once_into_one_buffer() -> None:
    model = _model()
    update = gather_weights(model, 3, zero_stage=0, dtype="bfloat16")
    assert update.dtype == "bfloat16" and update.version == 3
    assert update.num_bytes == 2 * sum(p.numel() for p in model.parameters())  # half of float32
    for (name, p), arr in zip(model.named_parameters(), update.arrays):
        assert arr.dtype == np.uint16 and np.array_equal(arr, _bits(p)), name
        assert torch.equal(to_torch(arr, "bfloat16"), p.detach().to(torch.bfloat16))
    assert contiguous_bytes(update.arrays) is not None      # back to back: sent without packing
    fp32 = gather_weights(model, 3, zero_stage=0)
    assert fp32.dtype == "float32" and all(a.dtype == np.float32 for a in fp32.arrays)


def test_bf16_round_trip_is_bit_exact_over_gloo() -> None:
    update = gather_weights(_model(1), 1, zero_stage=0, dtype="bfloat16")
    client = ThreadClient()
    sender = GlooTrainerChannel.open(client, OpenContext(bucket_bytes=8 << 10))
    try:
        timing = sender.send(update)
        assert timing.num_bytes == update.num_bytes and timing.path == "gloo"
    finally:
        sender.close()
    got = client.got[0]
    assert got.dtype == "bfloat16" and got.names == update.names
    assert all(np.array_equal(a, b) for a, b in zip(update.arrays, got.arrays))


def test_bf16_round_trip_is_bit_exact_through_shared_memory() -> None:
    update = gather_weights(_model(2), 5, zero_stage=0, dtype="bfloat16")
    writer = SharedWriter()
    try:
        info, write_s = writer.write_once(update)
        again, second = writer.write_once(update)         # one write per version, whatever the workers
        assert again is info and second == 0.0 and write_s >= 0.0
        got = SegmentReader().update(ShmUpdateInfo(**asdict(info)))
        assert got.dtype == "bfloat16" and got.version == 5
        assert all(np.array_equal(a, b) for a, b in zip(update.arrays, got.arrays))
    finally:
        writer.close()


def test_non_finite_bf16_and_wrong_storage_are_refused_in_one_line() -> None:
    arr = np.zeros((4, 4), dtype=np.uint16)
    spec = WeightSpec({"w": (4, 4)})
    validate_update(WeightUpdate(1, ("w",), (arr,), dtype="bfloat16"), spec)
    bad = arr.copy()
    bad[1, 2] = 0x7F80                                      # bfloat16 +inf
    with pytest.raises(WeightUpdateError, match="^w: non-finite values$"):
        validate_update(WeightUpdate(1, ("w",), (bad,), dtype="bfloat16"), spec)
    with pytest.raises(WeightUpdateError, match="uint16 bit patterns"):
        validate_update(WeightUpdate(1, ("w",), (np.zeros((4, 4), np.float32),), dtype="bfloat16"), spec)


def test_path_choice_by_placement_and_forced() -> None:
    cpu_a, cpu_a2, cpu_b = Placement("a"), Placement("a"), Placement("b")
    gpu0, gpu0_again, gpu1 = Placement("a", "cuda", "g0"), Placement("a", "cuda", "g0"), Placement("a", "cuda", "g1")
    assert choose_path(cpu_a, cpu_a2) == "shm"
    assert choose_path(cpu_a, cpu_b) == "gloo"
    both = frozenset({"ipc", "nccl"})
    assert choose_path(gpu0, gpu0_again, gpu_paths=both) == "ipc"
    assert choose_path(gpu0, gpu1, gpu_paths=both) == "nccl"
    assert choose_path(gpu0, gpu0_again) == "shm"             # GPU paths not given: host memory
    assert choose_path(gpu0, gpu1, "nccl") == "nccl"          # forced: taken between two GPUs
    assert choose_path(cpu_a, cpu_b, "gloo") == "gloo" and choose_path(cpu_a, cpu_a2, "gloo") == "gloo"
    for forced, trainer, worker, match in (("shm", cpu_a, cpu_b, "different nodes"),
                                           ("ipc", gpu0, gpu1, "one GPU"),
                                           ("nccl", cpu_a, cpu_a2, "on GPUs"),
                                           ("nccl", gpu0, gpu0_again, "share one GPU"),
                                           ("ipc", gpu0, gpu0_again, "installed vLLM")):
        with pytest.raises(PathError, match=match) as info:
            choose_path(trainer, worker, forced)  # type: ignore[arg-type]
        assert "\n" not in str(info.value) and "--rollout.weight_path" in str(info.value)


def test_publisher_takes_the_shared_memory_path_on_one_machine() -> None:
    clients = [ShmClient(), ShmClient()]
    pub = WeightPublisher(clients, background=False)
    try:
        for v in (1, 2):
            pub.publish(gather_weights(_model(v), v, zero_stage=0, dtype="bfloat16"))
            want = gather_weights(_model(v), v, zero_stage=0, dtype="bfloat16")
            for c in clients:   # each version read while it is the segment's
                assert c.got[-1].version == v
                assert all(np.array_equal(a, b) for a, b in zip(want.arrays, c.got[-1].arrays))
        assert set(pub.paths.values()) == {"shm"}
        assert {t.path for t in pub.send_timings} == {"shm"} and len(pub.send_timings) == 4
    finally:
        pub.close()


def test_a_transfer_whose_peer_dies_ends_within_its_timeout_in_one_line() -> None:
    client = ThreadClient(dies=True)
    sender = GlooTrainerChannel.open(client, OpenContext(timeout_s=3.0))
    t = time.perf_counter()
    try:
        with pytest.raises(Exception) as info:
            sender.send(gather_weights(_model(), 1, zero_stage=0, dtype="bfloat16"))
    finally:
        sender.close()
    assert time.perf_counter() - t < 3.0 + 10.0
    assert "\n" not in str(info.value).strip()


def test_a_version_gathered_into_shared_memory_is_handed_over_without_a_second_write() -> None:
    import os

    clients = [ShmClient()]
    pub = WeightPublisher(clients, background=False)
    try:
        assert pub.allocator() is None                      # no worker on the shm path yet
        assert pub.set_workers(clients) == ["shm"]
        allocate = pub.allocator()
        assert allocate is not None
        update = gather_weights(_model(4), 4, zero_stage=0, dtype="bfloat16", allocate=allocate)
        where = gathered_in(update)
        assert where is not None and os.path.exists(where[0])
        pub.publish(update)
        timing = pub.send_timings[-1]
        assert timing.path == "shm"
        got = clients[0].got[-1]
        assert all(np.array_equal(a, b) for a, b in zip(update.arrays, got.arrays))
        path = where[0]
        del update, got, where
        clients[0].got.clear()
        clients[0].reader.close()
        pub.publish(gather_weights(_model(5), 5, zero_stage=0, dtype="bfloat16", allocate=allocate))
        import gc

        gc.collect()
        assert not os.path.exists(path)                     # the old version's file went with it
    finally:
        pub.close()


def test_files_of_dead_processes_are_swept_and_live_ones_kept() -> None:
    import os
    import subprocess
    import sys

    from pipeline_rl.weight_sync.channels.shm import shm_dir, sweep_stale

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = shm_dir() / f"pipeline_rl_gather-{dead}-test0000"
    live = shm_dir() / f"pipeline_rl_gather-{os.getpid()}-test0000"
    for p in (stale, live):
        p.write_bytes(b"x")
    try:
        assert sweep_stale() >= 1
        assert not stale.exists() and live.exists()
    finally:
        for p in (stale, live):
            p.unlink(missing_ok=True)


def test_a_memory_filesystem_too_small_sends_over_gloo_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline_rl.weight_sync.channels import shm

    monkeypatch.setattr(shm, "check_space", _no_space)
    client = ThreadClient()
    pub = WeightPublisher([client], background=False)
    try:
        update = gather_weights(_model(6), 6, zero_stage=0, dtype="bfloat16")
        pub.publish(update)
        assert pub.paths and set(pub.paths.values()) == {"gloo"}
        assert pub.stats().offer_failures == 0 and client.got[-1].version == 6
        assert all(np.array_equal(a, b) for a, b in zip(update.arrays, client.got[-1].arrays))
    finally:
        pub.close()


def _no_space(size: int) -> None:
    from pipeline_rl.weight_sync.channels.shm import ShmSpaceError

    raise ShmSpaceError(f"shared memory: 0 MB free, an update needs {size / 1e6:.0f} MB")
