"""Rewards that are slow, remote or broken (``pipeline_rl.rollout.scoring``,
``pipeline_rl.tasks.remote_reward``).

Unit level, with the real scorer and a list as the buffer: ``async def`` and ``def``
rewards run concurrently (on the event loop, on a pool of ``--task.reward_concurrency``
threads), a call past ``--task.reward_timeout_s`` scores 0 and is counted, a reward that
raises or returns a non-number is counted with its first failure kept as one line,
``--task.reward_errors fail`` and a reward that never succeeds stop the worker. The remote
reward against an HTTP server on 127.0.0.1: one POST per group, keep-alive, a 5xx retried,
a server down at start-up or staying down. Then the flags, and one short run of the real
pipeline with a failing ``async def`` reward: the first failure is one console line, the
rest are counted on the step lines, in metrics.jsonl and in the summary.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.rewards import json_reply
from pipeline_rl.cli import UsageError, build_parser, parse_config
from pipeline_rl.config import TaskConfig
from pipeline_rl.rollout.engines.engine import FinishedSequence
from pipeline_rl.rollout.request_key import RequestKey
from pipeline_rl.rollout.rollout_shape import FinishedEpisode
from pipeline_rl.rollout.scoring import PendingGroup, RewardFailed, Scorer, reward_source
from pipeline_rl.rollout.single_turn import sequence_episode
from pipeline_rl.rollout.worker_stats import Counters, RewardTally
from pipeline_rl.samples import Group
from pipeline_rl.tasks.base import RewardFn, Task, TaskError
from pipeline_rl.tasks.build import build_task

TESTS = Path(__file__).resolve().parent
N = 4


@pytest.fixture(autouse=True)
def plugin_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))


class _Rig:
    """A scorer for ``task`` (its ``--task.reward`` when it has one) sending into a list."""

    def __init__(self, task: Task, reward_fn: RewardFn | None = None, **flags: Any) -> None:
        cfg = TaskConfig(**flags)
        self.task, self.sent, self.failures = task, [], []  # type: ignore[var-annotated]
        self.counters, self.lock = Counters(), threading.Lock()
        self.scorer = Scorer(0, N, cfg, reward_source(cfg, task, reward_fn), self, self.counters, self.lock,
                             self.failures.append)
        self.wait_s = 0.0

    def send(self, group: Group) -> None:   # SenderLike
        self.sent.append(group)

    def score(self, texts: Callable[[int], list[str]], prompt_ids: range) -> dict[int, list[float]]:
        """Hand over one group per prompt id (completions ``texts(prompt_id)``), wait for all."""
        for pid in prompt_ids:
            done = {i: _finished(pid, i, t) for i, t in enumerate(texts(pid))}
            self.scorer.group_done(PendingGroup(pid, self.task.prompt(pid), (1, 2), done))
        self.scorer.drain()
        return {g.prompt_id: g.rewards for g in self.sent if g.prompt_id in prompt_ids}

    def tally(self) -> RewardTally:
        with self.lock:
            return self.counters.snapshot(0, 0, 0.0, 0, 0.0).rewards

    def close(self) -> None:
        self.scorer.close()


def _finished(pid: int, i: int, text: str) -> FinishedEpisode:
    one = np.ones(1, dtype=np.int32)
    seq = FinishedSequence(f"{pid}:{i}", one, np.full(1, -0.5, dtype=np.float32), one * 0, text, "stop")
    return sequence_episode(RequestKey(pid, i), seq)


@pytest.fixture
def rig_of() -> Iterator[Callable[..., _Rig]]:
    rigs: list[_Rig] = []

    def make(spec: str | None = None, reward_fn: RewardFn | None = None, **flags: Any) -> _Rig:
        task = build_task(TaskConfig(name="sort", reward=spec, **flags))
        rigs.append(_Rig(task, reward_fn, reward=spec, **flags))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


def _same(text: str) -> Callable[[int], list[str]]:
    return lambda pid: [text] * N


# --- concurrency, timing --------------------------------------------------------------------

def test_async_reward_calls_overlap_on_the_event_loop(rig_of: Callable[..., _Rig]) -> None:
    rig = rig_of("reward_plugin:async_half")
    t0 = time.perf_counter()
    rewards = rig.score(_same("x"), range(4))            # 16 calls of 0.2 s: 3.2 s one after another
    elapsed = time.perf_counter() - t0
    assert rewards == {pid: [0.5] * N for pid in range(4)}
    assert elapsed < 1.5, elapsed
    t = rig.tally()
    assert (t.calls, t.errors, t.timeouts, t.first_error) == (16, 0, 0, None)
    assert t.seconds >= 16 * 0.19 and 0.19 <= t.busy_s <= elapsed


def test_def_reward_runs_on_reward_concurrency_threads(rig_of: Callable[..., _Rig]) -> None:
    lock, running, peak, threads = threading.Lock(), [0], [0], set()

    def slow(prompt: str, completion: str, meta: Any) -> float:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            threads.add(threading.current_thread().name)
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return 1.0

    rig = rig_of(reward_fn=slow, reward_concurrency=3)
    assert rig.score(_same("x"), range(4)) == {pid: [1.0] * N for pid in range(4)}
    assert peak[0] == 3 and len(threads) == 3 and all(n.startswith("reward-0") for n in threads)
    assert rig.tally().calls == 16


def test_builtin_reward_is_one_call_per_group(rig_of: Callable[..., _Rig]) -> None:
    rig = rig_of()
    answer = rig.task.prompt(5).answer
    assert rig.score(lambda pid: [answer, "9", answer, ""], range(5, 6)) == {5: [1.0, 0.0, 1.0, 0.0]}
    assert rig.tally().calls == 1 and rig.scorer.source.name == "of the sort task"


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_reward_slower_than_the_timeout_scores_zero_and_is_counted(kind: str, rig_of: Callable[..., _Rig]) -> None:
    import asyncio

    def slow(prompt: str, completion: str, meta: Any) -> float:
        time.sleep(1.0 if completion == "slow" else 0.0)
        return 1.0

    async def slow_async(prompt: str, completion: str, meta: Any) -> float:
        await asyncio.sleep(1.0 if completion == "slow" else 0.0)
        return 1.0

    rig = rig_of(reward_fn=slow if kind == "def" else slow_async, reward_timeout_s=0.2)
    t0 = time.perf_counter()
    rewards = rig.score(lambda pid: ["slow", "a", "b", "c"], range(3))
    assert time.perf_counter() - t0 < 0.9
    assert rewards == {pid: [0.0, 1.0, 1.0, 1.0] for pid in range(3)}
    t = rig.tally()
    assert (t.timeouts, t.errors) == (3, 0) and not rig.failures
    assert t.first_error is not None and "TimeoutError: no answer within 0.2 s (--task.reward_timeout_s)" in t.first_error


# --- failures ---------------------------------------------------------------------------------

def test_raising_and_non_number_rewards_first_line_and_counts(rig_of: Callable[..., _Rig],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    rig = rig_of("reward_plugin:picky")
    with caplog.at_level(logging.DEBUG, logger="pipeline_rl.rollout.scoring"):
        assert rig.score(_same("raise"), range(7, 8)) == {7: [0.0] * N}
        first = rig.tally().first_error
        assert rig.score(lambda pid: ["text", "nan", "ok", "ok"], range(8, 10)) == {8: [0, 0, 1, 1], 9: [0, 0, 1, 1]}
    question = rig.task.prompt(7).question
    assert first == f"reward reward_plugin:picky failed on prompt 7 ('{question}'): ValueError: no digits here"
    t = rig.tally()
    assert (t.errors, t.timeouts, t.first_error) == (N + 4, 0, first) and not rig.failures
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and first in warned[0].getMessage()        # the rest at debug level only
    assert "TypeError: returned str '0.5', not a number" in caplog.text
    assert "ValueError: returned nan, not a finite number" in caplog.text


def test_reward_errors_fail_stops_at_the_first_failure(rig_of: Callable[..., _Rig]) -> None:
    rig = rig_of("reward_plugin:picky", reward_errors="fail")
    rig.score(lambda pid: ["ok", "ok", "nan", "ok"], range(1))
    assert rig.failures and isinstance(rig.failures[0], RewardFailed)
    assert str(rig.failures[0]).startswith("reward reward_plugin:picky failed on prompt 0 ")
    assert str(rig.failures[0]).endswith("ValueError: returned nan, not a finite number (--task.reward_errors fail)")


def test_a_reward_that_never_succeeds_stops_the_worker(rig_of: Callable[..., _Rig]) -> None:
    rig = rig_of("reward_plugin:picky")
    rig.score(_same("raise"), range(7))                   # 28 failures: not yet
    assert not rig.failures
    rig.score(_same("raise"), range(7, 8))
    assert rig.failures and "failed on all of its first 32 completions; last: reward" in str(rig.failures[0])


# --- the remote reward ------------------------------------------------------------------------

class _Judge(BaseHTTPRequestHandler):
    """Scores exact matches; answers 503 to the next ``server.fail_next`` requests."""

    protocol_version = "HTTP/1.1"   # keep-alive

    def do_POST(self) -> None:
        srv: Any = self.server
        batch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.requests.append(batch)
            srv.peers.add(self.client_address)
            busy = srv.fail_next > 0
            srv.fail_next -= busy
        if self.path != "/score":
            return json_reply(self, 404, b'"no such path"')
        if busy:
            return json_reply(self, 503, b'"busy"')
        json_reply(self, 200, json.dumps([float(x["completion"] == x["answer"]) for x in batch]).encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def judge() -> Iterator[Any]:
    srv: Any = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    srv.requests, srv.peers, srv.fail_next, srv.lock = [], set(), 0, threading.Lock()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}/score"
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_remote_reward_one_post_per_group_kept_alive(judge: Any, rig_of: Callable[..., _Rig]) -> None:
    rig = rig_of(judge.url, reward_concurrency=2)
    assert judge.requests == [[]]                                       # the start-up probe
    rewards = rig.score(lambda pid: [rig.task.prompt(pid).answer, "x", "", rig.task.prompt(pid).answer], range(8))
    assert rewards == {pid: [1.0, 0.0, 0.0, 1.0] for pid in range(8)}
    posts = judge.requests[1:]
    assert len(posts) == 8 and all(len(b) == N for b in posts)          # one POST per group of n
    p = rig.task.prompt(0)
    assert {"prompt": p.question, "completion": "x", "answer": p.answer} in [x for b in posts for x in b]
    assert len(judge.peers) <= 1 + 2                                    # the probe's + one per thread
    t = rig.tally()
    assert (t.calls, t.errors, t.first_error) == (8, 0, None)


def test_remote_reward_retries_5xx_then_counts_a_server_that_stays_down(judge: Any,
                                                                         rig_of: Callable[..., _Rig]) -> None:
    rig = rig_of(judge.url, reward_concurrency=1)
    answer = rig.task.prompt(0).answer
    judge.fail_next = 2
    assert rig.score(lambda pid: [answer] * N, range(1)) == {0: [1.0] * N}   # third attempt answered
    assert len(judge.requests) == 1 + 3 and rig.tally().errors == 0
    judge.fail_next = 100
    assert rig.score(lambda pid: [answer] * N, range(1, 2)) == {1: [0.0] * N}
    t = rig.tally()
    assert t.errors == N and t.first_error is not None
    assert t.first_error.endswith("RemoteRewardError: HTTP 503 Service Unavailable (after 4 attempts)")
    assert t.first_error.startswith(f"reward {judge.url} failed on prompt 1 ")


def test_remote_reward_down_or_wrong_at_start_up_is_one_line(judge: Any, tiny_model_dir: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline_rl.driver import run

    down = f"http://127.0.0.1:{_closed_port()}/score"
    with pytest.raises(TaskError, match=r"^task.reward: the remote reward .* failed its start-up check "
                                        r"\(POST \[\]\): ConnectionRefusedError"):
        build_task(TaskConfig(reward=down))
    with pytest.raises(TaskError, match=r"\(POST \[\]\): HTTP 404 Not Found$"):
        build_task(TaskConfig(reward=judge.url.replace("/score", "/nope")))
    cfg, _ = parse_config(["--model.path", tiny_model_dir, "--out-dir", str(tmp_path / "out"),
                           "--task.reward", down], check_cpu=True)
    capsys.readouterr()
    assert run(cfg) == 2                                               # the driver, before anything starts
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("async_grpo.py: error: task.reward: the remote reward "), err


# --- the flags --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (["--task.reward_concurrency", "0"], "--task.reward_concurrency"),
    (["--task.reward_timeout_s", "0"], "--task.reward_timeout_s"),
    (["--task.reward_errors", "ignore"], "--task.reward_errors"),
    (["--task.reward", "ftp://example.com/score"], "--task.reward"),
])
def test_bad_reward_flags_are_one_line_naming_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_config(argv, check_cpu=True)
    assert "\n" not in str(err.value) and str(err.value).startswith(flag), str(err.value)


def test_reward_flags_defaults_and_help() -> None:
    t = parse_config(["--task.reward", "https://judge.example:8443/v1/score"], check_cpu=True)[0].task
    assert (t.reward, t.reward_concurrency, t.reward_timeout_s, t.reward_errors) == (
        "https://judge.example:8443/v1/score", 64, 60.0, "zero")
    text = " ".join(build_parser().format_help().split())
    for needle in ('[{"prompt": ..., "completion": ..., "answer": ... or null}, ...]', "JSON list of as many numbers",
                   "--task.reward_concurrency", "--task.reward_timeout_s", "--task.reward_errors"):
        assert needle in text, needle


# --- one real run -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_with_plugins() -> Iterator[None]:
    """A local Ray whose workers can import ``reward_plugin`` (tests/ on their path)."""
    import os

    import ray

    from pipeline_rl.run.local_ray import start_local
    from pipeline_rl.runtime_env import ACTOR_ENV

    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    start_local(num_cpus=2, object_store_mb=200, env={**ACTOR_ENV, "PYTHONPATH": path}, logging_level=30,
                log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_real_run_tells_the_first_reward_failure_once_and_counts_the_rest(
        ray_with_plugins: None, tiny_model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """The launcher's entry point with an ``async def`` reward failing on every third prompt."""
    from pipeline_rl.driver import run
    from pipeline_rl.metrics import read_metrics
    from tiny_run import tiny_run_config

    out = tmp_path / "run"
    cfg = tiny_run_config(tiny_model_dir, out, "--max-steps", "6", "--task.reward", "reward_plugin:flaky_async")
    with caplog.at_level(logging.WARNING, logger="pipeline_rl.run.recorder"):
        assert run(cfg) == 0
    told = [r.getMessage() for r in caplog.records if "reward reward_plugin:flaky_async failed" in r.getMessage()]
    assert len(told) == 1, told
    assert told[0].startswith("rollout worker 0: reward reward_plugin:flaky_async failed on prompt ")
    assert "ValueError: judge unavailable (scored 0; further reward failures are counted" in told[0]
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 6 and rows[-1]["reward_errors"] > 0 and rows[-1]["reward_timeouts"] == 0
    assert rows[-1]["reward_s"] > 0.001 and 0 < rows[-1]["reward_busy_frac"] <= 1
    stdout = capsys.readouterr().out
    assert any("| reward errors " in line for line in stdout.splitlines() if line.startswith("step"))
    assert f"| reward errors / timeouts (scored 0) | {rows[-1]['reward_errors']} / 0 |" in " ".join(stdout.split())


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["reward_plugin:exact", "reward_plugin:compute_score"])
def test_trl_and_verl_reward_functions_as_written_run_the_default_task(
        spec: str, ray_with_plugins: None, tiny_model_dir: str, tmp_path: Path) -> None:
    """TRL's ``exact(prompts, completions, answer, **kwargs)`` and verl's ``compute_score(
    data_source, solution_str, ground_truth, extra_info=None)``, unchanged, for 20 steps."""
    from pipeline_rl.driver import run
    from pipeline_rl.metrics import read_metrics
    from tiny_run import tiny_run_config

    out = tmp_path / "run"
    assert run(tiny_run_config(tiny_model_dir, out, "--max-steps", "20", "--task.reward", spec)) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 20 and rows[-1]["reward_errors"] == 0 and rows[-1]["reward_timeouts"] == 0
    assert rows[-1]["reward_unscored"] == 0 and rows[-1]["reward_s"] > 0
