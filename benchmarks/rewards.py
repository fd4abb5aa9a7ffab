"""Slow and remote rewards against an instant one, in the default run.

Usage::

    python -m benchmarks.rewards [--steps 200] [--repeats 1] [--json PATH] [--md PATH]

Five runs of the real pipeline (the default run: built-in model, sort task,
``--staleness 2``; held-out evaluation off) on one local Ray, back to back, the same
reward in all five (exact match with the sort task's answer), reached in four ways:

- ``instant``: the task's own reward;
- ``plugin-50ms``: a plug-in ``def`` reward (``--task.reward benchmarks.rewards:sleepy``)
  that sleeps 50 ms per completion first, as a reward model or a sandbox would;
- ``remote-20ms``: a remote reward (``--task.reward http://127.0.0.1:PORT/score``) served by
  this process (``http.server``), answering each group's batch after 20 ms;
- ``trl-50ms``: a plug-in reward of TRL's form (``--task.reward benchmarks.rewards:sleepy_batch``,
  ``f(prompts, completions, answer, **kwargs)``), called once per group, that sleeps 50 ms
  per call first;
- ``plugin-50ms-s4`` and ``trl-50ms-s4``: ``plugin-50ms`` and ``trl-50ms`` at ``--staleness 4``
  (not part of the acceptance): a
  reward's latency ages every sample, so it spends the staleness budget (at most
  ``(staleness + 1) x groups per step`` groups granted ahead of the trainer, docs/design.md
  section 2), and a larger budget buys the time back.

The slow arms run at the default ``--task.reward_concurrency`` (64) and
``--task.reward_timeout_s``. Reported per run: steps per second over the steps after the
first ``WARMUP`` (from the recorder's clock), the mean reward call and the share of the
worker's time with a reward in flight (from ``metrics.jsonl``), reward failures, and the
training reward; and each slow arm's steps per second as a ratio of ``instant``'s in the
same round (acceptance, for ``plugin-50ms``, ``remote-20ms`` and ``trl-50ms``: at least 0.8). With
``--repeats`` the rounds rotate the order of the arms and the figures are medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from benchmarks.common import Outcome, at_least, config, hardware, main as bench_main, ray_session, run_pipeline
from pipeline_rl.tasks.base import Prompt
from pipeline_rl.tasks.builtin import exact_match

#: Steps left out of the steps-per-second figure (start-up, the first weight syncs).
WARMUP = 10
#: What each slow arm's steps per second must reach, as a share of the instant arm's.
ACCEPT = 0.8
PLUGIN_SLEEP_S = 0.05
#: The arms the acceptance is on.
ACCEPTED_ARMS = ("plugin-50ms", "remote-20ms", "trl-50ms")
REMOTE_LATENCY_S = 0.02


def sleepy(prompt: str, completion: str, meta: Prompt) -> float:
    """The sort task's reward, after 50 ms (the ``plugin-50ms`` arm)."""
    time.sleep(PLUGIN_SLEEP_S)
    return exact_match(completion, meta.answer)


def sleepy_batch(prompts: list[str], completions: list[str], answer: list[str], **kwargs: object) -> list[float]:
    """The sort task's reward in TRL's form, after 50 ms per batch (the ``trl-50ms`` arm)."""
    time.sleep(PLUGIN_SLEEP_S)
    return [exact_match(c, a) for c, a in zip(completions, answer)]


class _Scores(BaseHTTPRequestHandler):
    """The remote arm's server: each batch answered after 20 ms with exact-match scores."""

    protocol_version = "HTTP/1.1"   # keep-alive, as a real reward server would

    def do_POST(self) -> None:
        batch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(REMOTE_LATENCY_S)
        json_reply(self, 200, json.dumps([exact_match(x["completion"], x["answer"] or "") for x in batch]).encode())

    def log_message(self, *args: Any) -> None:
        pass


def json_reply(handler: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
    """Answer ``handler``'s request: ``status`` and ``body`` as JSON, the connection kept alive."""
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@contextlib.contextmanager
def remote_reward() -> Iterator[str]:
    """The URL of a reward server on the loopback address, served for the block."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scores)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="reward-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score"
    finally:
        server.shutdown()
        server.server_close()


@dataclass(frozen=True, slots=True)
class RewardRun:
    name: str
    steps: int
    steps_per_s: float
    reward_call_ms: float
    reward_busy_frac: float
    reward_failures: int
    reward_first: float
    reward_last: float


def one_run(name: str, out: Path, steps: int, flags: list[str]) -> RewardRun:
    cfg = config(["--staleness", "2", "--max-steps", str(steps), "--out-dir", str(out), *flags])
    rows = run_pipeline(cfg)
    timed = rows[WARMUP - 1:]
    span = float(timed[-1]["time_s"]) - float(timed[0]["time_s"]) if len(timed) > 1 else 0.0
    k = max(1, len(rows) // 10)
    return RewardRun(
        name=name, steps=len(rows), steps_per_s=(len(timed) - 1) / span if span > 0 else 0.0,
        reward_call_ms=1e3 * statistics.fmean(float(r["reward_s"]) for r in timed),
        reward_busy_frac=statistics.fmean(float(r["reward_busy_frac"]) for r in timed),
        reward_failures=int(rows[-1]["reward_errors"]) + int(rows[-1]["reward_timeouts"]),
        reward_first=statistics.fmean(float(r["reward_mean"]) for r in rows[:k]),
        reward_last=statistics.fmean(float(r["reward_mean"]) for r in rows[-k:]))


def median_run(runs: list[RewardRun]) -> RewardRun:
    """Median figures over rounds (counts and rewards of the last round)."""
    last = runs[-1]
    return RewardRun(name=last.name, steps=last.steps, steps_per_s=statistics.median(r.steps_per_s for r in runs),
                     reward_call_ms=statistics.median(r.reward_call_ms for r in runs),
                     reward_busy_frac=statistics.median(r.reward_busy_frac for r in runs),
                     reward_failures=last.reward_failures, reward_first=last.reward_first,
                     reward_last=last.reward_last)


def markdown(runs: dict[str, RewardRun], ratios: dict[str, float], accepted: bool) -> str:
    lines = ["| reward | steps | steps/s | x instant | reward call (mean) | worker time in rewards "
             "| failures | train reward first -> last 10% |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in runs.values():
        ratio = f"{ratios[r.name]:.2f}" if r.name in ratios else "1"
        lines.append(f"| {r.name} | {r.steps} | {r.steps_per_s:.2f} | {ratio} | {r.reward_call_ms:.1f} ms "
                     f"| {r.reward_busy_frac:.2f} | {r.reward_failures} | {r.reward_first:.3f} -> {r.reward_last:.3f} |")
    judged = ", ".join(n for n in ACCEPTED_ARMS if n in ratios)
    lines += ["", f"Acceptance ({judged} at least {ACCEPT}x the instant arm's steps/s): "
              f"{'pass' if accepted else 'FAIL'}."]
    return "\n".join(lines)


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=200, help="Steps per run (default 200).")
    p.add_argument("--arms", default="plugin-50ms,remote-20ms,trl-50ms,plugin-50ms-s4", help="The slow arms "
                   "to run beside instant, comma-separated (also: trl-50ms-s4).")
    p.add_argument("--repeats", type=int, default=1, help="Rounds of the five runs, each in a rotated "
                   "order; figures are medians over rounds.")


def run(args: argparse.Namespace) -> Outcome:
    at_least(args, steps=WARMUP + 2, repeats=1)
    rounds: list[dict[str, RewardRun]] = []
    with ray_session(), remote_reward() as url, tempfile.TemporaryDirectory(prefix="rewards_") as tmp:
        arms = {"instant": [], "plugin-50ms": ["--task.reward", "benchmarks.rewards:sleepy"],
                "remote-20ms": ["--task.reward", url],
                "trl-50ms": ["--task.reward", "benchmarks.rewards:sleepy_batch"],
                "plugin-50ms-s4": ["--task.reward", "benchmarks.rewards:sleepy", "--staleness", "4"],
                "trl-50ms-s4": ["--task.reward", "benchmarks.rewards:sleepy_batch", "--staleness", "4"]}
        names = ["instant", *(n for n in arms if n != "instant" and n in args.arms.split(","))]
        for r in range(args.repeats):
            order = names[r % len(names):] + names[:r % len(names)]
            rounds.append({n: one_run(n, Path(tmp) / f"{n}_{r}", args.steps, arms[n]) for n in order})
    runs = {n: median_run([rd[n] for rd in rounds]) for n in names}
    # Each slow arm against the instant arm of its own round (runs close in time share the
    # machine's load), the median over rounds.
    ratios = {n: statistics.median(rd[n].steps_per_s / rd["instant"].steps_per_s if rd["instant"].steps_per_s
                                   else 0.0 for rd in rounds) for n in names[1:]}
    accepted = all(ratios[n] >= ACCEPT for n in ACCEPTED_ARMS if n in ratios)
    table = markdown(runs, ratios, accepted)
    if args.repeats > 1:
        table += "\n\n" + f"Medians over {args.repeats} rounds (orders rotated); per round, steps/s: " + "; ".join(
            ", ".join(f"{n} {rd[n].steps_per_s:.2f}" for n in names) for rd in rounds) + "."
    return Outcome({"hardware": hardware(), "steps": args.steps, "warmup": WARMUP, "ratios": ratios, "accepted": accepted,
                    "runs": {k: asdict(v) for k, v in runs.items()},
                    "rounds": [{k: asdict(v) for k, v in rd.items()} for rd in rounds]}, table,
                   status=0 if accepted else 1)


def main(argv: list[str] | None = None) -> int:
    return bench_main("rewards", __doc__, argv, run, flags=flags)


if __name__ == "__main__":
    raise SystemExit(main())
