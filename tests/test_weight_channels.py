"""The one channel interface (``pipeline_rl.weight_sync.channels.channel``): every CPU path's
bfloat16 round trip bit-exact through open / send / close; the nccl path's collective code
run on a gloo group (vLLM's packed cut, packing, a refused update drained, a dead peer
ending within its timeout in one line) and refused in one line where NCCL cannot run;
the host path's GPU-side copies run on CPU tensors."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from pipeline_rl.weight_sync.channels.channel import TrainerChannel, open_channel
from pipeline_rl.weight_sync.publish.gather import gather_weights
from pipeline_rl.weight_sync.channels.host_gpu import DeviceStaging, device_to_host
from pipeline_rl.weight_sync.message import DeviceCopy, WeightUpdate, WeightUpdateError
from pipeline_rl.weight_sync.channels.nccl import NcclTrainerChannel, chunk_plan
from pipeline_rl.weight_sync.protocol import OpenContext
from pipeline_rl.weight_sync.channels.shm import SharedWriter, StatusCell
from staging_helpers import ShmClient, ThreadClient


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(97, 48), torch.nn.Linear(48, 200), torch.nn.LayerNorm(200))


def _bf16(seed: int, version: int) -> WeightUpdate:
    return gather_weights(_model(seed), version, zero_stage=0, dtype="bfloat16")


def _open(path: str, client: ThreadClient, shared: SharedWriter) -> TrainerChannel:
    context = OpenContext(shared=shared, bucket_bytes=8 << 10, timeout_s=5.0)
    if path == "nccl":   # the same collective code as on GPUs, on a gloo group
        return NcclTrainerChannel.open(client, context, backend="gloo")
    return open_channel(path, client, context)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["shm", "gloo", "nccl"])
def test_every_path_round_trips_bf16_bit_exact_through_the_interface(path: str) -> None:
    client = ShmClient() if path == "shm" else ThreadClient()
    shared = SharedWriter()
    channel = _open(path, client, shared)
    try:
        for v in (1, 2):
            sent = _bf16(v, v)
            timing = channel.send(sent)
            assert timing.path == path and timing.num_bytes == sent.num_bytes
            got = client.got[-1]
            assert got.version == v and got.names == sent.names
            assert all(np.array_equal(a, b) and a.dtype == np.uint16 for a, b in zip(sent.arrays, got.arrays))
        assert client.finished == ["1", "2"]
    finally:
        channel.close()
        shared.close()


def test_nccl_cuts_chunks_as_vllms_packed_broadcast_does() -> None:
    assert [list(c) for c in chunk_plan([10, 20, 5, 100, 1, 1, 30], 32)] == [[0, 1, 2], [3], [4, 5, 6]]
    assert chunk_plan([], 32) == []


def test_nccl_on_gloo_packs_scattered_arrays_and_drains_a_refused_update() -> None:
    rng = np.random.default_rng(0)
    shapes = [(300, 64), (64,), (7, 3), (2048, 16)]
    good = WeightUpdate(2, tuple(f"p{i}" for i in range(4)),
                        tuple(rng.standard_normal(s).astype(np.float32) for s in shapes))   # not back to back
    bad_arrays = tuple(a.copy() for a in good.arrays)
    bad_arrays[3][5, 5] = np.inf
    bad = WeightUpdate(1, good.names, bad_arrays)
    client = ThreadClient()
    # vLLM's pack_tensors packs them: its first import takes seconds, inside the timeout
    channel = NcclTrainerChannel.open(client, OpenContext(bucket_bytes=16 << 10, timeout_s=60.0), backend="gloo")
    try:
        with pytest.raises(WeightUpdateError, match="^p3: non-finite values$"):
            channel.send(bad)
        channel.send(good)            # the refused one was drained: this one arrives whole
        assert [u.version for u in client.got] == [2]
        assert all(np.array_equal(a, b) for a, b in zip(good.arrays, client.got[0].arrays))
    finally:
        channel.close()


def test_nccl_on_gloo_a_dead_peer_ends_the_send_within_its_timeout_in_one_line() -> None:
    client = ThreadClient(dies=True)
    channel = NcclTrainerChannel.open(client, OpenContext(timeout_s=3.0), backend="gloo")
    t = time.perf_counter()
    try:
        with pytest.raises(Exception) as info:
            channel.send(_bf16(1, 1))
    finally:
        channel.close()
    assert time.perf_counter() - t < 3.0 + 5.0
    assert "\n" not in str(info.value).strip()


def test_forcing_nccl_where_it_cannot_run_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline_rl.weight_sync.channels.nccl as nccl

    assert nccl.nccl_refusal(2) is None
    assert nccl.nccl_refusal(0) == nccl.nccl_refusal(1).replace("has 1", "has 0")  # type: ignore[union-attr]
    monkeypatch.setattr(nccl, "gpu_count", lambda: 1)   # one GPU (or none): whatever this machine has
    with pytest.raises(WeightUpdateError, match="^nccl: needs CUDA and at least 2 GPUs") as info:
        open_channel("nccl", ThreadClient(), OpenContext())
    assert "\n" not in str(info.value)


def test_host_path_copies_are_bit_exact_and_keep_the_layout() -> None:
    """The host path's two copies (here on CPU tensors: the same code as on GPUs)."""
    sent = _bf16(3, 4)
    flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in sent.arrays])).view(torch.bfloat16)
    raw = device_to_host(flat, None)
    assert np.array_equal(raw.view(np.uint16), np.concatenate([a.reshape(-1) for a in sent.arrays]))
    opened = DeviceStaging().copy_in(sent, None)
    assert [n for n, _ in opened.tensors] == list(sent.names)
    for (_, t), a in zip(opened.tensors, sent.arrays):
        assert t.dtype == torch.bfloat16 and np.array_equal(t.view(torch.int16).numpy().view(np.uint16), a)


def test_a_gpu_gathered_version_reaches_shm_workers_through_the_writer() -> None:
    """A version gathered on the trainer's device (here a CPU tensor stands in for the GPU's)
    is copied whole into the writer's segment, once for every worker, bit-exact."""
    sent = _bf16(5, 7)
    flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in sent.arrays])).view(torch.bfloat16)
    on_device = WeightUpdate(7, sent.names, (), dtype="bfloat16",
                             device=DeviceCopy(flat, tuple(a.shape for a in sent.arrays)))
    clients, shared = [ShmClient(), ShmClient()], SharedWriter()
    try:
        for client in clients:
            open_channel("shm", client, OpenContext(shared=shared)).send(on_device)
            got = client.got[-1]
            assert got.version == 7 and all(np.array_equal(a, b) for a, b in zip(sent.arrays, got.arrays))
    finally:
        shared.close()


def test_the_copy_beside_generation_reports_ready_or_failed_through_the_cell() -> None:
    """``DeviceStaging.start_copy`` (a GPU worker's copy and check beside generation; here
    on CPU tensors), reporting to a status cell as the receiver does: READY with the update
    bit-exact, or FAILED with the check's error."""
    sent = _bf16(6, 8)
    cell = StatusCell.create()
    try:
        def report(ok: bool) -> None:
            cell.set(8, StatusCell.READY if ok else StatusCell.FAILED)

        future = DeviceStaging().start_copy(sent, None, lambda opened: None, report)
        opened = future.result(timeout=30)
        assert cell.get(8) == StatusCell.READY
        assert all(np.array_equal(t.view(torch.int16).numpy().view(np.uint16), a)
                   for (_, t), a in zip(opened.tensors, sent.arrays))

        def refuse(opened: Any) -> None:
            raise WeightUpdateError("p0: non-finite values")

        failed = DeviceStaging().start_copy(sent, None, refuse, report)
        with pytest.raises(WeightUpdateError, match="non-finite"):
            failed.result(timeout=30)
        assert cell.get(8) == StatusCell.FAILED
    finally:
        cell.unlink()
