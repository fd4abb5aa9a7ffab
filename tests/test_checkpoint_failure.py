"""A failed or stuck checkpoint write, on any rank, ends the run quickly: the failing rank
leaves its one-line cause in the ``.partial`` folder, every rank raises it at its next step
(or within a second of one), a write that stops progressing fails after its bound while a
slow one that progresses does not, and the driver's waits for checkpoint calls are bounded
(``training.checkpoint_progress``, ``training.checkpoint_writer``, ``run/checkpoints.py``)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from benchmarks.synthetic import synthetic_groups
from pipeline_rl.config import Config
from pipeline_rl.training.checkpoint import CheckpointError, RunState
from pipeline_rl.net import rendezvous_port
from tests.test_checkpoint import make_cfg

_LINE = (r"checkpoint step_000000: rank 1 failed to write its part: OSError: No space left on device "
         r"\([0-9,]+ MiB free on its disk\)")


def _no_space() -> None:
    raise OSError("No space left on device")


# ------------------------------------------------------------------ markers, stalls (no trainer)

def test_rank_0_raises_at_once_on_a_failure_marker(tmp_path: Path) -> None:
    """Rank 0 waits for rank 1's part; rank 1 leaves its failure marker: rank 0 raises its
    line at once (before: it waited for rank 1's part up to 1800 s)."""
    from pipeline_rl.training.checkpoint_writer import finish_part

    part = tmp_path / "step_000000.partial"
    part.mkdir()
    state = RunState(version=0, data_position=0, world_size=2, zero_stage=0)
    raised: list[BaseException] = []

    def rank_0() -> None:
        try:
            finish_part(part, tmp_path / "step_000000", 0, 2, state)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            raised.append(e)

    waiting = threading.Thread(target=rank_0, daemon=True)
    waiting.start()
    time.sleep(0.2)
    (part / ".failed-rank1").write_text("OSError: No space left on device (12 MiB free on its disk)\n")
    waiting.join(timeout=3)
    assert not waiting.is_alive() and raised, "rank 0 still waits for rank 1's part"
    assert isinstance(raised[0], CheckpointError) and re.fullmatch(_LINE, str(raised[0])), raised
    assert part.exists() and not (tmp_path / "step_000000").exists()   # never completes


def test_every_rank_knows_another_ranks_failed_write(tmp_path: Path) -> None:
    from pipeline_rl.training.checkpoint_writer import CheckpointWriter, finish_part

    part = tmp_path / "step_000000.partial"
    part.mkdir()
    state = RunState(version=0, data_position=0, world_size=2, zero_stage=0)
    rank0, rank1 = CheckpointWriter(rank=0, world_size=2), CheckpointWriter(rank=1, world_size=2)
    rank0.submit(part, lambda: finish_part(part, tmp_path / "step_000000", 0, 2, state))   # waits for rank 1
    time.sleep(0.2)
    start = time.monotonic()
    rank1.submit(part / "rng_state_rank1.pt", _no_space)
    with pytest.raises(CheckpointError) as seen_by_0:
        rank0.wait(timeout_s=10)   # not the 30 s stall bound: the marker says it at once
    assert time.monotonic() - start < 2.0
    with pytest.raises(CheckpointError) as seen_by_1:
        rank1.check()
    for e in (seen_by_0, seen_by_1):
        assert re.fullmatch(_LINE, str(e.value)), str(e.value)
    assert (part / ".failed-rank1").read_text().startswith("OSError: No space left on device")
    rank0.check()   # each failure is raised once
    rank1.check()
    assert part.exists() and not (tmp_path / "step_000000").exists()   # never completes
    rank0.close(5)
    rank1.close(5)


def test_a_write_that_stops_progressing_fails_and_a_slow_one_that_grows_does_not(tmp_path: Path) -> None:
    from pipeline_rl.training.checkpoint_writer import CheckpointWriter, finish_part, written_marker

    part = tmp_path / "step_000004.partial"
    part.mkdir()

    def slow() -> None:   # 1.2 s, two bounds, with its file growing all along
        with open(part / "big.pt", "ab") as f:
            for _ in range(8):
                f.write(b"x" * 1024)
                f.flush()
                time.sleep(0.15)
        written_marker(part, 1).touch()

    state = RunState(version=4, data_position=16, world_size=2, zero_stage=0)
    writer = CheckpointWriter(rank=1, world_size=2, stall_s=0.6)
    writer.submit(part, slow)
    finish_part(part, tmp_path / "step_000004", 0, 2, state, stall_s=0.6)   # rank 0 waits it out
    writer.wait(timeout_s=10)
    assert (tmp_path / "step_000004" / "big.pt").stat().st_size == 8 * 1024

    stuck, gate = tmp_path / "step_000008.partial", threading.Event()
    stuck.mkdir()
    writer.submit(stuck, lambda: gate.wait(30))
    time.sleep(0.2)
    writer.check()   # not yet past its bound
    time.sleep(0.6)
    with pytest.raises(CheckpointError, match=r"^checkpoint step_000008: no progress writing it for 1 s "
                                              r"\(rank\(s\) 0, 1 not done\)$"):
        writer.check()
    with pytest.raises(CheckpointError, match="no progress"):
        writer.wait()   # a stuck write is never waited for without a bound
    gate.set()
    writer.close(5)


def test_a_step_under_way_raises_a_failed_write_within_a_second() -> None:
    from pipeline_rl.training.checkpoint_writer import CheckpointWriter
    from pipeline_rl.training.rank_step import await_step

    writer, step = CheckpointWriter(), Future[int]()   # a step that is not done (a long one)
    writer.submit(Path("step_000010.partial"), _no_space)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="checkpoint step_000010: rank 0 failed to write its part"):
        await_step(step, writer.check, every_s=0.05)
    assert time.monotonic() - start < 1.0
    step.set_result(3)
    assert await_step(step, writer.check) == 3   # reported once; a done step is its result
    writer.close(5)


# ------------------------------------------------------------------ the driver's waits

class _Ref:
    def __init__(self, after_s: float | None, error: Exception | None = None) -> None:
        self.at = None if after_s is None else time.monotonic() + after_s
        self.error = error

    def done(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


class _Calls:
    def pending(self, refs: Any, timeout_s: float) -> list[Any]:
        time.sleep(0.02)
        return [r for r in refs if not r.done()]

    def get(self, ref: Any, timeout_s: float | None = None) -> Any:   # as Ray's: waits for the answer
        from pipeline_rl.run.remote_calls import NoAnswer

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not ref.done():
            if deadline is not None and time.monotonic() > deadline:
                raise NoAnswer(TimeoutError("no answer"))
            time.sleep(0.02)
        if ref.error is not None:
            raise ref.error
        return "ok"


class _Rank:
    def __init__(self, after_s: float | None, error: Exception | None = None) -> None:
        method = type("Method", (), {"remote": lambda _, *args: _Ref(after_s, error)})()
        self.save_checkpoint = self.wait_for_checkpoints = method


@pytest.mark.timeout(30)
def test_the_driver_raises_any_ranks_failure_at_once_and_bounds_a_silent_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from pipeline_rl.run import checkpoints
    from pipeline_rl.run.remote_calls import ActorRaised, NoAnswer

    policy = checkpoints.CheckpointPolicy(Config(), tmp_path)
    failed = ActorRaised(CheckpointError("checkpoint step_000000: rank 1 failed to write its part: OSError: x"))
    start = time.monotonic()
    with pytest.raises(ActorRaised, match="rank 1 failed"):   # rank 0 has not answered: not waited for
        policy.save([_Rank(None), _Rank(0.0, failed)], 0, _Calls())
    assert time.monotonic() - start < 1.0

    monkeypatch.setattr(checkpoints, "_NO_PROGRESS_S", 0.4)
    monkeypatch.setattr(checkpoints, "_SAY_AFTER_S", 0.1)
    part = tmp_path / "checkpoints" / "step_000002.partial"
    part.mkdir(parents=True)

    def grow() -> None:   # a slow write: 1.2 s, three bounds, progressing
        for i in range(12):
            (part / f"f{i}").write_bytes(b"x")
            time.sleep(0.1)

    writing = threading.Thread(target=grow)
    writing.start()
    caplog.set_level(logging.INFO, logger="pipeline_rl.run.checkpoints")
    policy.written([_Rank(0.0), _Rank(1.3)], _Calls())
    writing.join()
    assert [r.message for r in caplog.records if "waiting" in r.message] == [
        "the last checkpoint: waiting for trainer rank(s) 1 (being written: step_000002.partial; "
        "the wait goes on while the writing progresses)"]
    with pytest.raises(NoAnswer, match=r"^TimeoutError: the last checkpoint: no answer from trainer rank\(s\) 0, 1 "
                                       r"and no checkpoint writing progressed for 0 s$"):
        policy.written([_Rank(None), _Rank(None)], _Calls())


# ------------------------------------------------------------------ two real ranks

class _Groups:
    """A batch source of synthetic groups (``RankStep``'s ``BatchSource``)."""

    def get_batch(self, num_groups: int, trainer_version: int, timeout_s: float | None = None, *,
                  rank: int = 0) -> list[Any]:
        return synthetic_groups(num_groups, 4, seed=100 * trainer_version + rank, version=trainer_version)

    def set_version(self, version: int) -> None:
        pass


def _rank_main(rank: int, port: int, model_dir: str, folder: str, conn: Connection) -> None:
    """Child process: one of two DeepSpeed ranks (gloo) taking commands from the test, as from
    the driver: ``save`` (a background checkpoint), ``step`` (``RankStep``), ``stop``. Rank 1's
    disk is full: every ``torch.save`` it makes fails."""
    os.environ.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    import torch

    from pipeline_rl.training.rank_step import RankStep
    from pipeline_rl.training.trainer import Trainer

    trainer = Trainer(make_cfg(num_ranks=2), model_dir, rank=rank, world_size=2, master_port=port)
    step = RankStep(trainer, _Groups(), None)
    if rank == 1:
        torch.save = lambda *args, **kwargs: _no_space()
    conn.send("ready")
    while (command := conn.recv()) != "stop":
        try:
            if command == "save":
                trainer.save_checkpoint(Path(folder) / "step_000000", background=True)
            else:
                step(timeout_s=10.0)
            conn.send("ok")
        except Exception as e:  # noqa: BLE001 - the test reads it as the driver would
            conn.send(f"{type(e).__name__}: {e}")
    os._exit(0)   # as the driver ends a failed run's actors: no clean-up (DeepSpeed's takes seconds)


def _answers(ends: list[Connection], command: str | None, timeout_s: float) -> list[str]:
    """Send ``command`` to both ranks; both answers (an AssertionError when one is late)."""
    for end in ends if command else []:
        end.send(command)
    deadline = time.monotonic() + timeout_s
    for rank, end in enumerate(ends):
        assert end.poll(max(0.0, deadline - time.monotonic())), f"rank {rank}: no answer to {command} in {timeout_s} s"
    return [str(end.recv()) for end in ends]


@pytest.mark.timeout(240)
def test_a_failed_write_on_rank_1_of_2_ends_the_steps_within_30_s(tiny_model_dir: str, tmp_path: Path) -> None:
    """Two real ranks save in the background; rank 1's write fails (a full disk). The next
    step raises, in one line naming rank 1, the checkpoint and the cause, well within 30 s
    (before: the steps went on, rank 0 waited 1800 s for rank 1's part, and the failure was
    raised only by rank 1's next save)."""
    ctx = mp.get_context("spawn")
    port, pipes = rendezvous_port(), [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_rank_main, args=(r, port, tiny_model_dir, str(tmp_path), pipes[r][1]), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    ends = [end for end, _ in pipes]
    lines: list[str] = []
    try:
        assert _answers(ends, None, 180) == ["ready", "ready"]
        assert _answers(ends, "save", 60) == ["ok", "ok"]
        saved = time.monotonic()
        while not lines and time.monotonic() - saved < 30:
            lines = [a for a in _answers(ends, "step", 30) if a != "ok"]
        took = time.monotonic() - saved
    finally:
        for end in ends:
            try:
                end.send("stop")
            except OSError:
                pass
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert lines and took < 30, f"no rank raised the failed write within 30 s ({took:.0f} s of steps)"
    for line in lines:
        assert re.fullmatch(f"CheckpointError: {_LINE}", line), line
    assert not (tmp_path / "step_000000").exists()
    assert (tmp_path / "step_000000.partial" / ".failed-rank1").read_text().startswith("OSError: No space left")
