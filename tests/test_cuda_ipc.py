"""The ``ipc`` weight path (``pipeline_rl.weight_sync.channels.cuda_ipc``): chosen where the
trainer and a worker share a GPU, its update info told apart from the other paths',
a GPU-gathered update copied to host memory bit-exact for the byte paths, and refused
where it cannot go. The CUDA IPC round trip itself (a second process opens the
trainer's buffer) runs where a GPU is present."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from pipeline_rl.config import Config
from pipeline_rl.weight_sync.channels.cuda_ipc import (
    IpcUpdateInfo,
    check_opened,
    export_update,
    open_update,
    to_host,
)
from pipeline_rl.weight_sync.message import DeviceCopy, WeightSpec, WeightUpdate, WeightUpdateError, validate_update
from pipeline_rl.weight_sync.channels.paths import GPU_PATHS, Placement, choose_path
from pipeline_rl.weight_sync.publish.gather import gather_weights
from pipeline_rl.weight_sync.channels.channel import decode_update_info
from pipeline_rl.weight_sync.protocol import tagged


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(31, 16), torch.nn.Linear(16, 24))


def test_auto_takes_ipc_on_one_gpu_and_never_nccl() -> None:
    gpu0, gpu0_again, gpu1 = Placement("a", "cuda", "g0"), Placement("a", "cuda", "g0"), Placement("a", "cuda", "g1")
    assert choose_path(gpu0, gpu0_again, gpu_paths=GPU_PATHS) == "ipc"
    assert choose_path(gpu0, gpu1, gpu_paths=GPU_PATHS) == "shm"      # auto never nccl: host memory
    assert choose_path(gpu0, Placement("b", "cuda", "g0"), gpu_paths=GPU_PATHS) == "gloo"
    assert choose_path(gpu0, gpu0_again, "ipc", GPU_PATHS) == "ipc"
    assert choose_path(Placement("a"), Placement("a"), gpu_paths=GPU_PATHS) == "shm"


def test_config_takes_ipc_and_refuses_nccl_where_it_cannot_run_in_one_line() -> None:
    assert Config.model_validate({"rollout": {"weight_path": "ipc"}}).rollout.weight_path == "ipc"
    if torch.cuda.device_count() >= 2:
        assert Config.model_validate({"rollout": {"weight_path": "nccl"}}).rollout.weight_path == "nccl"
        return
    with pytest.raises(ValueError, match="nccl: needs CUDA and at least 2 GPUs"):
        Config.model_validate({"rollout": {"weight_path": "nccl"}})   # the command line: test_config


def _info(**changes: object) -> dict[str, object]:
    info = IpcUpdateInfo(4, ["w"], ["bfloat16"], [[2, 3]], "aGFuZGxl", "GPU-0")
    return {**tagged(info), **changes}


def test_ipc_info_is_told_apart_by_its_tag_and_a_bad_one_refused() -> None:
    info = _info()
    assert isinstance(decode_update_info(info), IpcUpdateInfo)
    assert decode_update_info(info).layout().total_bytes() == 12
    with pytest.raises(WeightUpdateError, match="^update_info for the ipc path") as e:
        decode_update_info({**info, "extra": 1})
    assert "\n" not in str(e.value)
    for tag in (None, "carrier-pigeon"):   # no guessing from the keys: an untagged message is refused
        untagged = {k: v for k, v in info.items() if k != "path"} | ({"path": tag} if tag else {})
        with pytest.raises(WeightUpdateError, match="path tag .* is not one of gloo, ipc, nccl, object_store, shm"):
            decode_update_info(untagged)


def test_gathered_on_gpu_copies_to_host_bit_exact() -> None:
    """A device update (here its buffer on the CPU, standing in for the GPU's) copied to
    host memory equals the host gather, bit for bit."""
    model = _model()
    host = gather_weights(model, 2, zero_stage=0, dtype="bfloat16")
    flat = torch.cat([p.detach().to(torch.bfloat16).reshape(-1) for p in model.parameters()])
    shapes = tuple(tuple(p.shape) for p in model.parameters())
    on_gpu = WeightUpdate(2, host.names, (), dtype="bfloat16", device=DeviceCopy(flat, shapes))
    assert on_gpu.num_bytes == host.num_bytes and on_gpu.num_params == host.num_params
    copied = to_host(on_gpu)
    assert copied.device is None and copied.names == host.names
    for a, b in zip(copied.arrays, host.arrays):
        assert a.dtype == np.uint16 and np.array_equal(a, b)
    assert to_host(host) is host


def test_device_update_refused_where_bytes_are_expected() -> None:
    spec = WeightSpec({"w": (2, 3)})
    on_gpu = WeightUpdate(1, ("w",), (), dtype="bfloat16",
                          device=DeviceCopy(torch.zeros(6, dtype=torch.bfloat16), ((2, 3),)))
    with pytest.raises(WeightUpdateError, match="on the trainer's GPU"):
        validate_update(on_gpu, spec)
    with pytest.raises(WeightUpdateError, match="^weights v1: the ipc path needs the update on the GPU$"):
        export_update(on_gpu)


def test_gather_on_device_stays_in_host_memory_on_cpu() -> None:
    update = gather_weights(_model(), 1, zero_stage=0, dtype="bfloat16", on_device=True)
    assert update.device is None and len(update.arrays) == 3


def _open_in_child(info: dict[str, object], out: "mp.Queue[object]") -> None:
    try:
        decoded = decode_update_info(info)   # through the one decoder, as the receiver does
        assert isinstance(decoded, IpcUpdateInfo)
        opened = open_update(decoded, 0)
        check_opened(opened, WeightSpec({n: tuple(t.shape) for n, t in opened.tensors}))
        out.put([t.float().cpu().numpy() for _, t in opened.tensors])
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out.put(repr(e))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_ipc_round_trip_in_another_process() -> None:
    model = _model().cuda()
    update = gather_weights(model, 1, zero_stage=0, dtype="bfloat16", on_device=True)
    assert update.device is not None and update.device.flat.is_cuda
    ctx = mp.get_context("spawn")
    out: "mp.Queue[object]" = ctx.Queue()
    child = ctx.Process(target=_open_in_child, args=(tagged(export_update(update)), out))
    child.start()
    got = out.get(timeout=120)
    child.join(30)
    assert isinstance(got, list), got
    for arr, p in zip(got, model.parameters()):
        assert np.array_equal(arr, p.detach().to(torch.bfloat16).float().cpu().numpy())
