"""Checkpoints written off the training thread: what is written is the state at the save,
whatever the trainer does meanwhile; failures come back in one line; a checkpoint is
complete only when every rank has written its part (failures across ranks and stalls:
``tests/test_checkpoint_failure.py``)."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.synthetic import synthetic_groups
from pipeline_rl.training.checkpoint import CheckpointError, RunState, latest_checkpoint, read_run_state
from pipeline_rl.training.checkpoint_writer import CheckpointWriter, finish_part, written_marker
from tests.test_checkpoint import make_cfg


def _ds_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model and optimizer tensors of DeepSpeed's file in ``ckpt``."""
    state = torch.load(next((ckpt / "deepspeed").rglob("mp_rank_00_model_states.pt")), weights_only=False)
    out = {f"module.{k}": v for k, v in state["module"].items()}
    for pid, s in state["optimizer"]["state"].items():
        out |= {f"opt.{pid}.{k}": v for k, v in s.items() if torch.is_tensor(v)}
    return out


def test_a_background_save_writes_the_state_at_the_save(tiny_model_dir: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline_rl.training.trainer import Trainer

    groups = [synthetic_groups(4, 4, seed=10 + i, version=i) for i in range(4)]
    ref, bg = Trainer(make_cfg(), tiny_model_dir), Trainer(make_cfg(), tiny_model_dir)
    for trainer in (ref, bg):
        trainer.step(groups[0])
        trainer.step(groups[1])
    sync_path = ref.save_checkpoint(tmp_path / "sync" / "step_000002")
    gate, save = threading.Event(), torch.save

    def held_save(*args: Any, **kwargs: Any) -> None:   # the writer writes nothing until the gate opens
        assert gate.wait(60)
        save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", held_save)
    path = bg.save_checkpoint(tmp_path / "bg" / "step_000002", background=True)
    bg.step(groups[2])   # the next steps change every weight and moment before the copy is written
    bg.step(groups[3])
    assert not path.exists() and latest_checkpoint(tmp_path / "bg") is None
    gate.set()
    bg.wait_for_checkpoints()
    assert latest_checkpoint(tmp_path / "bg") == path and read_run_state(path).version == 2
    assert not list(path.glob(".written-rank*"))
    for a, b in ((load_file(str(sync_path / "model.safetensors")), load_file(str(path / "model.safetensors"))),
                 (_ds_tensors(sync_path), _ds_tensors(path))):
        assert a.keys() == b.keys() and a
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-7, msg=name)
    ref.close()
    bg.close()


def test_a_failed_write_is_one_line_at_the_next_wait_and_the_writer_goes_on(tmp_path: Path) -> None:
    writer = CheckpointWriter()
    done: list[str] = []

    def fail() -> None:
        raise OSError("No space left on device\nsecond line")

    part = tmp_path / "step_000010.partial"
    part.mkdir()
    writer.submit(part / "deepspeed" / "state" / "mp_rank_00_model_states.pt", fail)
    writer.submit(part, lambda: done.append("skipped"))   # the rest of that save is moot
    with pytest.raises(CheckpointError) as e:
        writer.wait(timeout_s=10)
    assert re.fullmatch(r"checkpoint step_000010: rank 0 failed to write its part: OSError: No space left on "
                        r"device \([0-9,]+ MiB free on its disk\)", str(e.value)), str(e.value)
    assert str(e.value).endswith((part / ".failed-rank0").read_text().strip())   # its marker: the cause
    writer.wait(timeout_s=10)   # reported once
    writer.submit(tmp_path / "step_000020.partial", lambda: done.append("written"))
    writer.wait(timeout_s=10)
    assert done == ["written"]
    writer.close(timeout_s=5)


def test_a_slow_write_makes_wait_say_so() -> None:
    writer = CheckpointWriter()
    gate = threading.Event()
    writer.submit(Path("step_000010.partial"), lambda: gate.wait(10))
    with pytest.raises(CheckpointError, match="still going on after 0 s"):
        writer.wait(timeout_s=0.2)
    gate.set()
    writer.close(timeout_s=5)


def test_rank_0_publishes_only_when_every_rank_has_written_its_part(tmp_path: Path) -> None:
    final = tmp_path / "step_000004"
    part = tmp_path / "step_000004.partial"
    part.mkdir()
    state = RunState(version=4, data_position=16, world_size=2, zero_stage=2)
    publisher = threading.Thread(target=finish_part, args=(part, final, 0, 2, state))
    publisher.start()
    time.sleep(0.3)
    assert publisher.is_alive() and not final.exists()   # rank 1 has not written yet
    finish_part(part, final, 1, 2, state)
    publisher.join(timeout=5)
    assert json.loads((final / "run_state.json").read_text())["version"] == 4 and not part.exists()
    assert not written_marker(final, 0).exists() and not written_marker(final, 1).exists()


def test_rank_0_gives_up_on_a_rank_that_never_writes(tmp_path: Path) -> None:
    part = tmp_path / "step_000004.partial"
    part.mkdir()
    state = RunState(version=4, data_position=16, world_size=2, zero_stage=2)
    with pytest.raises(CheckpointError, match=r"step_000004: no progress writing it for 0 s \(rank\(s\) 1 not done\)"):
        finish_part(part, tmp_path / "step_000004", 0, 2, state, stall_s=0.2)
    assert part.exists() and not (tmp_path / "step_000004").exists()


def test_staging_copies_into_the_buffers_of_the_previous_save() -> None:
    from pipeline_rl.training.checkpoint_writer import Staging

    staging = Staging()
    live = {"module": {"w": torch.ones(3, 2), "b": torch.zeros(4)}, "steps": [torch.tensor(1), 7], "pair": (torch.ones(2), "x")}
    first = staging.copy(live, "model_states.pt")
    assert first["steps"][1] == 7 and first["pair"][1] == "x" and isinstance(first["pair"], tuple)
    live["module"]["w"].add_(1)   # the live state moves on; the copy does not
    assert torch.equal(first["module"]["w"], torch.ones(3, 2))
    second = staging.copy(live, "model_states.pt")
    assert second["module"]["w"].data_ptr() == first["module"]["w"].data_ptr()   # the same memory, new contents
    assert torch.equal(second["module"]["w"], torch.full((3, 2), 2.0))
    live["module"]["w"] = torch.ones(5, dtype=torch.float64)   # a changed shape or dtype gets a buffer of its own
    third = staging.copy(live, "model_states.pt")
    assert third["module"]["w"].dtype == torch.float64 and third["module"]["w"].data_ptr() != second["module"]["w"].data_ptr()
    other = staging.copy(live, "optim_states.pt")   # another file: other buffers
    assert other["module"]["b"].data_ptr() != third["module"]["b"].data_ptr()
    allocate = staging.array("weights")
    assert allocate(16) is allocate(16) and allocate(8).nbytes == 8


def test_two_background_saves_each_write_their_own_state(tiny_model_dir: str, tmp_path: Path) -> None:
    """The second save reuses the first one's host buffers and still writes the state at its own step."""
    from pipeline_rl.training.trainer import Trainer

    groups = [synthetic_groups(4, 4, seed=20 + i, version=i) for i in range(4)]
    ref, bg = Trainer(make_cfg(), tiny_model_dir), Trainer(make_cfg(), tiny_model_dir)
    for trainer in (ref, bg):
        trainer.step(groups[0])
        trainer.step(groups[1])
    bg.save_checkpoint(tmp_path / "bg" / "step_000002", background=True)
    for trainer in (ref, bg):
        trainer.step(groups[2])
        trainer.step(groups[3])
    sync_path = ref.save_checkpoint(tmp_path / "sync" / "step_000004")
    path = bg.save_checkpoint(tmp_path / "bg" / "step_000004", background=True)
    bg.step(groups[0])
    bg.wait_for_checkpoints()
    first = _ds_tensors(tmp_path / "bg" / "step_000002")
    for a, b in ((load_file(str(sync_path / "model.safetensors")), load_file(str(path / "model.safetensors"))),
                 (_ds_tensors(sync_path), _ds_tensors(path))):
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-7, msg=name)
    assert any(not torch.equal(first[n], v) for n, v in _ds_tensors(path).items())
    ref.close()
    bg.close()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux: a thread's own priority and CPUs")
def test_an_idle_writer_runs_at_the_lowest_priority_on_every_cpu(tmp_path: Path) -> None:
    """A large state's writes take only CPU time nobody else wants; a small state's keep the
    trainer's core and normal priority (written within a step, as a restart expects)."""
    seen: dict[str, Any] = {}

    def record(name: str) -> Any:
        return lambda: seen.update({name: (os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                                           os.sched_getaffinity(0))})

    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})   # this test's thread pinned, as a trainer's are
        idle, normal = CheckpointWriter(idle=True), CheckpointWriter()
        idle.submit(tmp_path, record("idle"))
        normal.submit(tmp_path, record("normal"))
        idle.wait(30)
        normal.wait(30)
    finally:
        os.sched_setaffinity(0, before)
    assert seen["idle"][0] == 19 and seen["idle"][1] >= before
    assert seen["normal"][0] == os.getpriority(os.PRIO_PROCESS, 0) and seen["normal"][1] == {min(before)}
    idle.close(5)
    normal.close(5)


def test_the_built_in_model_is_written_at_normal_priority(tiny_model_dir: str) -> None:
    from pipeline_rl.training.checkpoint_writer import IDLE_WRITE_MIN_BYTES
    from pipeline_rl.training.trainer import Trainer

    trainer = Trainer(make_cfg(), tiny_model_dir)
    assert not trainer.writer.idle and sum(p.numel() * 4 for p in trainer.engine.module.parameters()) < IDLE_WRITE_MIN_BYTES
    trainer.close()
