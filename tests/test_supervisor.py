"""The run's supervisor without Ray: stand-in actor handles and remote results drive a worker
death (restarted, then one too many), a trainer death, a buffer death and a stall, and each
must produce its one line (actor, cause, where to resume from). The evaluations read their
answers through it: a dead worker's share is lost by its notice, whichever sees the death first."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline_rl.config import Config
from pipeline_rl.run.checkpoints import CheckpointPolicy
from pipeline_rl.run.remote_calls import ActorDied, ActorRaised, ActorUnavailable, CallFailed, NoAnswer, WorkerLost
from pipeline_rl.run.life.supervise import OrchestratorError, Supervisor, WorkerSlot


class Ref:
    """A stand-in for a remote result: answered (a value, or a failure) or not yet."""

    def __init__(self, value: Any = None, error: CallFailed | None = None, answered: bool = True) -> None:
        self.value, self.error, self.answered = value, error, answered


class Method:
    """One actor method as Ray exposes it: ``.remote(...)`` returns a :class:`Ref`."""

    def __init__(self, answer: Callable[..., Ref]) -> None:
        self.answer = answer
        self.calls: list[tuple[Any, ...]] = []

    def remote(self, *args: Any) -> Ref:
        self.calls.append(args)
        return self.answer(*args)


class FakeCalls:
    def pending(self, refs: Sequence[Any], timeout_s: float) -> list[Any]:
        return [r for r in refs if not r.answered]

    def get(self, ref: Any, timeout_s: float | None = None) -> Any:
        if not ref.answered:
            raise NoAnswer(TimeoutError("no answer"))
        if ref.error is not None:
            raise ref.error
        return ref.value


def answered(value: Any = None) -> Callable[..., Ref]:
    return lambda *args: Ref(value)


def silent() -> Callable[..., Ref]:
    return lambda *args: Ref(answered=False)


def died(text: str) -> CallFailed:
    return ActorDied(RuntimeError(text))


class Buffer:
    def __init__(self, watch: Ref | None = None) -> None:
        stats = SimpleNamespace(fill=0, capacity=256, evicted={"stale": 0}, zero_variance=0,
                                admission=SimpleNamespace(used=10, limit=10, version=3))
        self.watch = Method(lambda: watch or Ref(answered=False))
        self.ping = Method(answered(True))
        self.stats = Method(answered(stats))
        self.worker_lost = Method(answered(2))


class Worker:
    def __init__(self, run: Ref) -> None:
        stats = SimpleNamespace(version=3, in_flight_groups=2, groups_sent=5)
        self.run = Method(lambda *args: run)
        self.ready = Method(answered(True))
        self.take_over = Method(answered(1))
        self.stats = Method(answered(stats))


class Trainer:
    def __init__(self, step: Ref | None = None) -> None:
        self.offer_latest = Method(answered(None))
        self.train_step = Method(lambda *args: step or Ref(answered=False))


def supervisor(tmp_path: Path, buffer: Buffer, workers: list[Worker], trainer: Trainer | None = None,
               on_lost: Callable[[WorkerLost], None] = lambda notice: None,
               **flags: Any) -> tuple[Supervisor, list[WorkerSlot], list[int]]:
    """The supervisor of ``workers``; the list it returns gets the index of each worker it restarts."""
    cfg = Config.model_validate({"out_dir": str(tmp_path), **flags})
    slots = [WorkerSlot(i, w) for i, w in enumerate(workers)]   # type: ignore[arg-type]
    for s in slots:
        s.start(3, cfg.groups_per_step)
    restarted: list[int] = []

    def lost(notice: WorkerLost) -> None:
        if notice.restarted:
            restarted.append(notice.index)
        on_lost(notice)

    sup = Supervisor(cfg, FakeCalls(), buffer, [trainer or Trainer()], slots,  # type: ignore[arg-type]
                     threading.Event(), CheckpointPolicy(cfg, tmp_path), lambda: 3, lost)
    return sup, slots, restarted


def test_a_dead_worker_is_restarted(tmp_path: Path) -> None:
    worker = Worker(Ref(error=died("The actor died unexpectedly")))
    trainer, buffer = Trainer(), Buffer()
    sup, slots, restarted = supervisor(tmp_path, buffer, [worker], trainer)
    worker_run_after = Ref(answered=False)
    worker.run.answer = lambda *args: worker_run_after
    sup.check()
    assert restarted == [0] and slots[0].restarts == 1 and slots[0].run_ref is worker_run_after
    assert trainer.offer_latest.calls == [([worker],)]      # the newest weights, at once
    assert worker.run.calls[-1] == ((1 << 28) + 3 * 4,)      # a fresh range of group ids
    assert buffer.worker_lost.calls == [(0,)]                 # its grants refunded once; a late request of the dead process is refused by its pid


def test_a_worker_that_dies_once_too_often_ends_the_run(tmp_path: Path) -> None:
    sup, _, _ = supervisor(tmp_path, Buffer(), [Worker(Ref(error=died("The actor died unexpectedly")))],
                           run={"max_worker_restarts": 0})
    with pytest.raises(OrchestratorError) as e:
        sup.check()
    assert str(e.value) == ("rollout worker 0 stopped 1 times, more than --run.max_worker_restarts=0 allows: "
                            "its process died (RuntimeError: The actor died unexpectedly); "
                            "no checkpoint was saved yet")


def test_an_exception_inside_a_worker_ends_the_run(tmp_path: Path) -> None:
    sup, _, _ = supervisor(tmp_path, Buffer(), [Worker(Ref(error=ActorRaised(ValueError("bad engine step"))))])
    with pytest.raises(OrchestratorError, match=r"^rollout worker 0 failed: ValueError: bad engine step "
                                                r"\(at version 3\); no checkpoint was saved yet$"):
        sup.check()


def test_a_dead_trainer_ends_the_run(tmp_path: Path) -> None:
    step = Ref(error=died("The actor died unexpectedly before finishing this task"))
    sup, _, _ = supervisor(tmp_path, Buffer(), [Worker(Ref(answered=False))], Trainer(step))
    with pytest.raises(OrchestratorError) as e:
        sup.await_step([step])
    assert str(e.value) == ("trainer failed: RuntimeError: The actor died unexpectedly before finishing "
                            "this task (at version 3); no checkpoint was saved yet")


def test_a_dead_buffer_is_named_as_the_buffer(tmp_path: Path) -> None:
    buffer = Buffer(watch=Ref(error=died("The actor died because its node died")))
    sup, _, _ = supervisor(tmp_path, buffer, [Worker(Ref(answered=False))])
    with pytest.raises(OrchestratorError) as e:
        sup.await_step([Ref(answered=False)])
    assert str(e.value).startswith("replay buffer failed: its process died (RuntimeError: The actor died "
                                   "because its node died); ")


def test_a_stall_says_who_waits_for_what(tmp_path: Path) -> None:
    sup, _, _ = supervisor(tmp_path, Buffer(), [Worker(Ref(answered=False))], watchdog_s=0.01)
    sup.watchdog.touch()
    with pytest.raises(OrchestratorError) as e:
        sup.await_step([Ref(answered=False)])
    line = str(e.value)
    assert line.startswith("no step completed for ") and "\n" not in line
    for part in ("the trainer waits for a batch of 4 groups at version 3",
                 "the buffer holds 0 groups (capacity 256, 0 evicted); admission budget 10/10 used at version 3",
                 "rollout worker 0 holds weights v3, 2 groups in flight, 5 sent, generating",
                 "no checkpoint was saved yet"):
        assert part in line, line


# -- evaluations read through the same stand-ins ---------------------------------------------
def _share() -> Any:
    from pipeline_rl.rollout.eval_feed import EvalResult

    return EvalResult(num_prompts=2, k=2, greedy_reward_sum=1.0, sampled_reward_sum=3.0, passed=2,
                      greedy_tokens=8, version_min=4, version_max=5)


class EvalWorker(Worker):
    """A rollout worker that also evaluates (its share answered, unless a test says otherwise);
    its generation loop runs until a test says otherwise."""

    def __init__(self) -> None:
        super().__init__(Ref(answered=False))
        self.evaluate = Method(answered(_share()))


def evaluations(tmp_path: Path, workers: list[EvalWorker]) -> tuple[Any, Supervisor, list[WorkerSlot], list[int]]:
    """Evaluations whose answers the supervisor reads and whose losses it reports, wired as the run does."""
    from pipeline_rl.config import EvalConfig
    from pipeline_rl.run.evaluations import Evaluations

    told: list[Callable[[WorkerLost], None]] = []
    sup, slots, restarted = supervisor(tmp_path, Buffer(), list(workers), on_lost=lambda n: told[0](n))
    ev = Evaluations(EvalConfig(every=5, num_prompts=4, k=2), clock=lambda: 1.5, calls=FakeCalls(),
                     answers=sup.answers)
    told.append(ev.worker_lost)
    return ev, sup, slots, restarted


def test_evaluations_wait_for_every_share_and_merge_them(tmp_path: Path) -> None:
    late = Ref(_share(), answered=False)
    workers = [EvalWorker(), EvalWorker()]
    workers[1].evaluate = Method(lambda *a: late)
    ev, _, _, _ = evaluations(tmp_path, workers)
    assert ev.launch(5, 5, workers)
    assert ev.poll() is None and ev.in_flight_step == 5          # one share still out
    late.answered = True
    done = ev.poll()
    assert done is not None and ev.in_flight_step is None
    assert (done.step, done.num_prompts, done.greedy_accuracy, done.mean_at_k) == (5, 4, 0.5, 0.75)
    assert (done.version_min, done.version_max, done.time_s) == (4, 5, 1.5)


def test_a_share_lost_with_its_worker_is_handled_by_the_supervisor(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The evaluation reads a share that failed because its worker died: the supervisor, not
    the evaluation, handles the death (the worker restarted once, its loop's call having
    failed alongside) and its notice makes the evaluation lost, in one line; the run goes on."""
    dead = died("The actor died unexpectedly")
    workers = [EvalWorker(), EvalWorker()]
    workers[1].evaluate = Method(lambda *a: Ref(error=dead))
    ev, sup, slots, restarted = evaluations(tmp_path, workers)
    assert ev.launch(10, 10, workers)
    slots[1].run_ref = Ref(error=dead)                            # the loop's call fails with the process
    with caplog.at_level("WARNING", logger="pipeline_rl.evaluation"):
        assert ev.poll() is None
    assert ev.lost == 1 and ev.in_flight_step is None and restarted == [1] and slots[1].restarts == 1
    assert [r.getMessage() for r in caplog.records if r.name == "pipeline_rl.evaluation"] == [
        "evaluation after step 10 lost: rollout worker 1: its process died (RuntimeError: The actor "
        "died unexpectedly)"]
    sup.check()
    assert restarted == [1]                                       # not restarted again by the loop
    assert ev.launch(15, 15, workers[:1]) and ev.poll() is not None   # later evaluations go on


def test_a_worker_death_the_supervisor_sees_first_loses_the_evaluation_unread(tmp_path: Path) -> None:
    workers = [EvalWorker(), EvalWorker()]
    never = Ref(answered=False)
    workers[0].evaluate = Method(lambda *a: never)
    ev, sup, slots, restarted = evaluations(tmp_path, workers)
    assert ev.launch(10, 10, workers)
    slots[0].run_ref = Ref(error=died("The actor died unexpectedly"))   # seen while awaiting a step
    sup.check()
    assert restarted == [0] and ev.lost == 1 and ev.in_flight_step is None
    assert ev.poll() is None and ev.lost == 1


def test_a_share_that_fails_while_its_worker_lives_is_lost_without_a_restart(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    workers = [EvalWorker()]
    workers[0].evaluate = Method(lambda *a: Ref(error=ActorUnavailable(RuntimeError("connection reset"))))
    ev, _, slots, restarted = evaluations(tmp_path, workers)
    assert ev.launch(10, 10, workers)
    with caplog.at_level("WARNING", logger="pipeline_rl.evaluation"):
        assert ev.poll() is None and ev.lost == 1 and restarted == [] and slots[0].restarts == 0
    assert caplog.records[-1].getMessage() == ("evaluation after step 10 lost: rollout worker 0: a call to it "
                                               "failed (RuntimeError: connection reset)")


def test_a_share_that_raised_is_raised(tmp_path: Path) -> None:
    workers = [EvalWorker()]
    workers[0].evaluate = Method(lambda *a: Ref(error=ActorRaised(ValueError("no evaluation task"))))
    ev, _, _, _ = evaluations(tmp_path, workers)
    assert ev.launch(10, 10, workers)
    with pytest.raises(ActorRaised, match="no evaluation task"):
        ev.poll()


def test_a_standby_takes_over_on_the_slots_core_or_is_swapped_back() -> None:
    """``WorkerSlot.standby_take_over``, the one takeover both the supervisor and a life's
    start use: the standby takes the slot on its core; a failed ``take_over`` swaps it back,
    not up, with its one line."""
    dead, standby = Worker(Ref()), Worker(Ref())
    slot = WorkerSlot(0, dead, core="core-0", standby=standby, standby_up=True)   # type: ignore[arg-type]
    assert slot.standby_take_over(FakeCalls(), 10.0) is None
    assert slot.handle is standby and slot.standby is dead and standby.take_over.calls == [("core-0",)]
    dead.take_over.answer = lambda *args: Ref(error=died("The actor died unexpectedly"))
    slot.standby_up = True
    assert slot.standby_take_over(FakeCalls(), 10.0) == "RuntimeError: The actor died unexpectedly"
    assert slot.handle is standby and slot.standby is dead and not slot.standby_up
