"""One rollout shape (``pipeline_rl/rollout/rollout_shape.py``): the three rollouts are one
protocol, and one driver (``rollout/rollout_driver.py``) runs every group's copies.

The worker's ``_rollout_of`` returns each of the three as a ``Rollout`` (mypy checks that
assignment); here the protocol is checked at run time, the driver's stepping on a fake engine
(no vLLM), and the source for who starts a group's copies."""

from __future__ import annotations

import ast
import inspect
import threading
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pipeline_rl.rollout.agents.runner import AgentRollout
from pipeline_rl.rollout.engines.engine import FinishedSequence, GenRequest, SamplingConfig
from pipeline_rl.rollout.episodes import EnvRollout
from pipeline_rl.rollout.request_key import RequestKey
from pipeline_rl.rollout.rollout_driver import RolloutDriver
from pipeline_rl.rollout.rollout_shape import (FinishedEpisode, Generate, OffLoop, Rollout, Trace, group_samples)
from pipeline_rl.rollout.single_turn import SingleTurn, sequence_episode
from pipeline_rl.rollout.worker_stats import Counters
from pipeline_rl.tasks.base import Prompt
from pipeline_rl.tasks.task_config import TaskConfig

PACKAGE = Path(__file__).resolve().parents[1] / "pipeline_rl"
SAMPLING = SamplingConfig(max_new_tokens=4)


class FakeEngine:
    """Finishes every request at the next step, one token each (the request's index + 1)."""

    tokenizer = None

    def __init__(self) -> None:
        self.added: list[GenRequest] = []
        self.copies: list[list[str]] = []
        self.queue: list[str] = []

    def add(self, request: GenRequest) -> None:
        self.added.append(request)
        self.queue.append(request.request_id)

    def add_copies(self, ids: list[str], prompt_ids: tuple[int, ...], sampling: SamplingConfig) -> None:
        self.copies.append(list(ids))
        self.queue += ids

    def step(self) -> list[FinishedSequence]:
        out, self.queue = self.queue, []
        return [FinishedSequence(rid, np.array([i + 1], np.int32), np.array([-0.5], np.float32),
                                 np.zeros(1, np.int32), f"t{i}", "stop") for i, rid in enumerate(out)]


class Scorer:
    def __init__(self) -> None:
        self.ended: list[tuple[int, int]] = []
        self.groups: list[Any] = []

    def episode_done(self, group: Any, index: int) -> None:
        self.ended.append((group.group_id, index))

    def group_done(self, group: Any) -> None:
        self.groups.append(group)


def _driver(rollout: Any, n: int = 3) -> tuple[RolloutDriver, FakeEngine, Scorer, list[Any]]:
    engine, scorer, answers = FakeEngine(), Scorer(), []
    driver = RolloutDriver(rollout, engine, n, scorer, Counters(), threading.Lock(), lambda: None,  # type: ignore[arg-type]
                           lambda *a: answers.append(a))
    return driver, engine, scorer, answers


def _step(driver: RolloutDriver, engine: FakeEngine) -> None:
    for seq in engine.step():
        driver.collect(seq, RequestKey.parse(seq.request_id))
    driver.pump()


class Env:
    def reset(self, prompt: Prompt) -> None:
        pass

    def step(self, turn: str) -> Any:
        from pipeline_rl.tasks.env import EnvReply

        return EnvReply(reward=1.0, done=True)


def test_the_three_rollouts_are_one_protocol() -> None:
    """Each is an ``async def __call__(key, prompt, prompt_ids, sampling) -> FinishedEpisode``
    with ``prompt_ids`` and ``close``, the protocol's own signature."""
    want = inspect.signature(Rollout.__call__)
    hints = typing.get_type_hints(Rollout.__call__)
    for cls in (SingleTurn, EnvRollout, AgentRollout):
        assert inspect.iscoroutinefunction(cls.__call__), cls
        assert list(inspect.signature(cls.__call__).parameters) == list(want.parameters), cls
        assert typing.get_type_hints(cls.__call__) == hints, cls
        assert callable(getattr(cls, "prompt_ids")) and callable(getattr(cls, "close")), cls
    env = EnvRollout(Env, TaskConfig(max_turns=2), SimpleNamespace(), 64, "shape", lambda line, t: None)  # type: ignore[arg-type]
    try:
        assert isinstance(SingleTurn(), Rollout) and isinstance(env, Rollout)
    finally:
        env.close()


def test_the_driver_is_the_only_place_a_groups_copies_are_run() -> None:
    """Only the driver starts a rollout's coroutine (``.send(None)``) and adds a group's copies
    (``add_copies``; the engines define it: the base class's loop, the in-process engine's
    own), and only the worker asks it to start a group."""
    callers: dict[str, set[str]] = {"add_copies": set(), "send(None)": set(), "start_group": set()}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name = node.func.attr
            if name == "send" and len(node.args) == 1 and isinstance(node.args[0], ast.Constant) \
                    and node.args[0].value is None:
                name = "send(None)"
            if name in callers:
                callers[name].add(rel)
    assert callers["add_copies"] <= {"rollout/rollout_driver.py", "rollout/engines/engine.py",
                                     "rollout/engines/engine_inprocess.py"}, callers
    assert "rollout/rollout_driver.py" in callers["add_copies"]
    assert callers["send(None)"] == {"rollout/rollout_driver.py"}, callers
    assert callers["start_group"] == {"rollout/worker.py"}, callers


def test_a_single_turn_group_goes_in_as_copies_and_out_as_its_sequences() -> None:
    driver, engine, scorer, _ = _driver(SingleTurn())
    prompt = Prompt(7, "1+1=", "2")
    driver.start_group(5, prompt, (1, 2), SAMPLING)
    assert engine.copies == [["5:0", "5:1", "5:2"]] and not engine.added and 5 in driver.pending
    _step(driver, engine)
    assert scorer.ended == [(5, 0), (5, 1), (5, 2)] and not driver.pending
    (group,) = scorer.groups
    built = group_samples(group.prompt_ids, [group.finished[i] for i in range(3)], [0.0, 1.0, 2.0])
    assert built.prompt_ids == (1, 2) and [c.token_ids.tolist() for c in built.completions] == [[1], [2], [3]]
    assert [c.reward for c in built.completions] == [0.0, 1.0, 2.0] and built.completions[0].mask is None


def test_an_evaluation_sample_is_one_request_and_an_answer() -> None:
    driver, engine, _, answers = _driver(SingleTurn())
    key = RequestKey.of_eval(3, 1, 0)
    driver.start_one(key, Prompt(0, "x", "y"), (4,), SAMPLING)
    assert [r.request_id for r in engine.added] == ["eval:3:1:0"]
    _step(driver, engine)
    (answer,) = answers
    assert answer[0] == key and answer[1] == "t0" and answer[2].tolist() == [0] and answer[3] is None


class TwoWaits:
    """A rollout awaiting work off the loop, then a turn: resumed from another thread."""

    def __init__(self) -> None:
        self.resumes: list[Any] = []

    async def __call__(self, key: RequestKey, prompt: Prompt, prompt_ids: tuple[int, ...],
                       sampling: SamplingConfig) -> FinishedEpisode:
        value = await OffLoop(self.resumes.append)
        seq = await Generate(key.at_turn(0).to_id(), prompt_ids + (value,), sampling)
        return FinishedEpisode(key, (Trace(seq.token_ids, seq.logprobs, seq.versions, "stop"),), seq.text, 1.0)

    def prompt_ids(self, prompt: Prompt) -> None:
        return None

    def close(self) -> None:
        pass


def test_an_off_loop_wait_is_resumed_once_at_the_next_pump() -> None:
    rollout = TwoWaits()
    driver, engine, scorer, _ = _driver(rollout, n=2)
    driver.start_group(0, Prompt(0, "x", "y"), (1,), SAMPLING)
    assert driver.waiting == 2 and not engine.added and not engine.copies
    threads = [threading.Thread(target=resume, args=(9,)) for resume in rollout.resumes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rollout.resumes[0](8)                          # a second resume of one wait: dropped
    assert driver.waiting == 2
    driver.pump()
    assert driver.waiting == 0 and [r.prompt_ids for r in engine.added] == [(1, 9), (1, 9)]
    assert [r.request_id for r in engine.added] == ["0:0#0", "0:1#0"]
    _step(driver, engine)
    assert [g.group_id for g in scorer.groups] == [0] and scorer.groups[0].finished[1].reward == 1.0


def test_a_rollout_that_awaits_anything_else_is_one_line() -> None:
    import asyncio

    class Sleeps(TwoWaits):
        async def __call__(self, key: RequestKey, prompt: Prompt, prompt_ids: tuple[int, ...],
                           sampling: SamplingConfig) -> FinishedEpisode:
            await asyncio.sleep(0)
            raise AssertionError("not reached")

    driver, _, _, _ = _driver(Sleeps(), n=1)
    with pytest.raises(TypeError, match="may await only Generate or OffLoop"):
        driver.start_group(0, Prompt(0, "x", "y"), (1,), SAMPLING)


def test_whole_samples_are_cut_at_the_prompt_they_share() -> None:
    """An agent's samples (each with its own prompt): the longest shared prefix before the
    first model token is the group's prompt; a sample of another first token is left out."""
    def whole(tokens: list[int], mask: list[int]) -> Trace:
        n = len(tokens)
        return Trace(np.array(tokens, np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32), "stop",
                     np.array(mask, np.uint8))

    key = RequestKey(0, 0)
    episodes = [FinishedEpisode(key, (whole([1, 2, 3, 7], [0, 0, 0, 1]), whole([1, 2, 5, 8], [0, 0, 0, 1])), "",
                                1.0, whole=True),
                FinishedEpisode(key, (whole([1, 2, 9], [0, 0, 1]), whole([4, 2, 9], [0, 0, 1])), "", 0.0, whole=True)]
    built = group_samples((), episodes, [1.0, 0.0])
    assert built.prompt_ids == (1, 2) and built.split == 2
    assert [c.token_ids.tolist() for c in built.completions] == [[3, 7], [5, 8], [9]]
    assert [c.reward for c in built.completions] == [1.0, 1.0, 0.0]
    assert sequence_episode(key, FinishedSequence("0:0", np.ones(1, np.int32), np.zeros(1, np.float32),
                                                  np.zeros(1, np.int32), "a", "length")).traces[0].finish == "length"
