"""End to end on CPU: real Ray, vLLM, DeepSpeed and ZeroMQ in short runs.

One local Ray (2 CPUs) serves the module's runs. Checked: the metrics file and
its keys, the lag bound, mixed-version samples under staleness >= 1, none
under staleness 0, the worker and the trainer pinned to a core each, a killed
rollout worker's standby taking its place mid-run (on its core) and a new standby built, a
resumable checkpoint, and a clean shutdown (no actor process left).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline_rl.config import Config
from pipeline_rl.metrics import read_metrics
from tiny_run import tiny_run_config

pytestmark = pytest.mark.slow

REQUIRED_KEYS = {"step", "version", "time_s", "reward_mean", "tokens_per_s", "lag_mean", "lag_max",
                 "evicted", "mismatch_kl", "masked_frac", "mixed_version_frac", "trainer_idle_frac",
                 "weight_update_stall_ms"}


def _config(tiny_model_dir: str, out: Path, *extra: str) -> Config:
    return tiny_run_config(tiny_model_dir, out, "--max-steps", "6", *extra)


def _run(cfg: Config, during: Any = None) -> list[dict[str, Any]]:
    from pipeline_rl.driver import resolve_model_dir
    from pipeline_rl.run.life.one_life import Orchestrator
    from pipeline_rl.run.life.start import open_run

    stop = threading.Event()
    with Orchestrator(cfg, resolve_model_dir(cfg), stop, open_run(cfg)) as orch:
        if during is not None:
            threading.Thread(target=during, args=(orch,), daemon=True).start()
        orch.train()
    return read_metrics(Path(cfg.out_dir) / "metrics.jsonl")


def test_async_run_metrics_lag_bound_and_worker_restart(ray_local: None, tiny_model_dir: str,
                                                         tmp_path: Path) -> None:
    import ray

    # 16 steps: the worker dies at step 3 or a few steps later (the steps of this tiny model
    # are milliseconds), and the buffer's stock at staleness 2 covers at most 3 more steps,
    # so the run can only finish by restarting the worker, which the last rows then count.
    steps = 16
    # The test's own Ray is not the run's: pinning there is asked for (the run pins nothing
    # on a Ray it did not start unless told). With a standby (run/life/slots.py): it, not Ray's
    # restart of the killed process, takes the slot; a standby is built at the lowest CPU
    # priority, so the bounds are wide for a machine busy with the tests beside this one.
    cfg = _config(tiny_model_dir, tmp_path / "run", "--staleness", "2", "--max-steps", str(steps),
                  "--ray.pin_cores", "true", "--rollout.standby", "true", "--watchdog-s", "600",
                  "--trainer.batch_timeout_s", "600")
    killed: list[int] = []
    cores: dict[str, list[int]] = {}
    seen: dict[str, Any] = {}

    def kill_worker_after_step_3(orch: Any) -> None:
        metrics = Path(cfg.out_dir) / "metrics.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                _take_over(orch, ray, killed, cores, seen)
                return
            time.sleep(0.01)

    rows = _run(cfg, kill_worker_after_step_3)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert REQUIRED_KEYS <= r.keys()
        assert 0 <= r["lag_max"] <= 2
    assert killed, "the worker was never killed"
    # The standby's process (the pid it had when built) took the slot and generated for it,
    # and the killed worker's handle (its process restarted by Ray) is the slot's new standby.
    assert seen.get("slot_handle_is_standby"), seen
    assert seen["generating_pid"] == seen["standby_pid"] != killed[0], seen
    assert seen["groups_sent"] > 0 and seen["tokens_generated"] > 0, seen
    assert seen["new_standby_pid"] not in (killed[0], seen["standby_pid"]), seen
    if len(os.sched_getaffinity(0)) >= 2:   # one worker and one rank: a core each (--ray.pin_cores true)
        assert len(cores["worker"]) == 1 and len(cores["trainer"]) == 1, cores
        assert cores["worker"] != cores["trainer"], cores
        # built unpinned, pinned to the dead worker's core by take_over; the new standby unpinned
        assert len(cores["standby"]) > 1 and cores["taken"] == cores["worker"], cores
        assert len(cores["new_standby"]) > 1, cores
    assert rows[-1]["worker_restarts"] >= 1
    assert any(r["mixed_version_frac"] > 0 for r in rows), "no in-flight weight update seen"
    ckpt = Path(cfg.out_dir) / "checkpoints"
    assert any(ckpt.iterdir())
    with pytest.raises(ProcessLookupError):
        os.kill(killed[0], 0)


def _take_over(orch: Any, ray: Any, killed: list[int], cores: dict[str, list[int]], seen: dict[str, Any]) -> None:
    """Kill worker 0 once its standby is built, and record what took its place. Generation is
    held (SIGSTOP) while the standby is built, and again while the killed worker's process is
    built anew as the next standby, so that the run cannot end before either; SIGCONT always."""
    slot = orch.actors.workers[0]
    pid = ray.get(slot.handle.pid.remote())
    trainer = ray.get(orch.actors.trainers[0].pid.remote())
    cores.update(worker=sorted(os.sched_getaffinity(pid)), trainer=sorted(os.sched_getaffinity(trainer)))
    standby = slot.standby
    assert standby is not None, "the run built no standby"
    with _held(pid):
        seen["standby_pid"] = standby_pid = ray.get(standby.pid.remote(), timeout=300)   # once it is built
        cores["standby"] = sorted(os.sched_getaffinity(standby_pid))
        os.kill(pid, signal.SIGKILL)
    killed.append(pid)
    deadline = time.monotonic() + 120
    while slot.handle is not standby and time.monotonic() < deadline:
        time.sleep(0.05)
    seen["slot_handle_is_standby"] = slot.handle is standby
    seen["generating_pid"] = ray.get(slot.handle.pid.remote(), timeout=30)
    cores["taken"] = sorted(os.sched_getaffinity(seen["generating_pid"]))
    stats = ray.get(slot.handle.stats.remote(), timeout=30)
    while stats.groups_sent == 0 and time.monotonic() < deadline:   # groups from it reach the buffer
        time.sleep(0.05)
        stats = ray.get(slot.handle.stats.remote(), timeout=30)
    seen["groups_sent"], seen["tokens_generated"] = stats.groups_sent, stats.tokens_generated
    with _held(seen["generating_pid"]):
        seen["new_standby_pid"] = new = _answer(lambda: slot.standby.pid.remote(), ray, 300)
        cores["new_standby"] = sorted(os.sched_getaffinity(new))


class _held:
    """A process stopped (SIGSTOP) for the ``with`` block, continued (SIGCONT) after it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def __exit__(self, *exc: object) -> None:
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _answer(call: Any, ray: Any, timeout_s: float) -> Any:
    """The answer of ``call()`` from an actor Ray may still be restarting (asked again until then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(call(), timeout=10)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_staleness_zero_is_synchronous_and_evaluates_held_out_prompts(
        ray_local: None, tiny_model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Staleness 0: no lag, no mixed versions, no evictions. ``--eval.every 3`` over 6
    steps: evaluations of the starting weights, after step 3 and after step 6 (the end),
    on the rollout worker's engine, logged to eval.jsonl, the console and the summary;
    the step rows carry the policy's entropy."""
    from pipeline_rl.metrics import read_evals

    cfg = _config(tiny_model_dir, tmp_path / "sync", "--staleness", "0", "--eval.every", "3",
                  "--eval.num_prompts", "6", "--eval.k", "2")
    rows = _run(cfg)
    assert len(rows) == 6
    for r in rows:
        assert r["lag_max"] == 0 and r["mixed_version_frac"] == 0.0 and r["evicted"] == 0
        assert r["entropy"] > 0
    evals = read_evals(Path(cfg.out_dir) / "eval.jsonl")
    assert [e.step for e in evals] == [0, 3, 6]
    for e in evals:
        assert (e.num_prompts, e.k) == (6, 2)
        assert 0.0 <= e.greedy_accuracy <= 1.0 and 0.0 <= e.mean_at_k <= e.pass_at_k <= 1.0
        assert e.version_min <= e.version_max and e.greedy_len_mean > 0
    assert evals[0].version_min == 0                       # the start was evaluated
    assert evals[-1].version_min == evals[-1].version_max == 6   # the end: the final weights alone
    out = capsys.readouterr().out
    assert "eval after step 3" in out and "held-out greedy accuracy (step 0 -> 6)" in out


def test_ppo_epochs_keep_one_version_per_step_and_resume(ray_local: None, tiny_model_dir: str,
                                                         tmp_path: Path) -> None:
    """``--algorithm.ppo_epochs 2``: two optimizer steps per batch, one version. Steps,
    versions, checkpoint names and the resumed run all count in that unit; the lag bound
    holds. With a warm-up and cosine schedule and an EMA of the weights: metrics.jsonl has
    each step's rate, each checkpoint its ema/ folder, and the resumed run continues both."""
    from pipeline_rl.training.checkpoint import read_run_state
    from pipeline_rl.training.schedule import lr_factor

    ppo = ("--algorithm.loss", "ppo", "--algorithm.ppo_epochs", "2", "--trainer.checkpoint_every", "2",
           "--trainer.lr_schedule", "cosine", "--trainer.warmup_steps", "1", "--trainer.ema_decay", "0.9")
    cfg = _config(tiny_model_dir, tmp_path / "ppo", "--max-steps", "4", *ppo)
    rows = _run(cfg)
    assert [(r["step"], r["version"]) for r in rows] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    lrs = [cfg.trainer.lr * lr_factor(s, schedule="cosine", warmup_steps=1, total_steps=4) for s in range(4)]
    assert [r["lr"] for r in rows] == pytest.approx(lrs)
    assert all(r["lag_max"] <= cfg.staleness for r in rows)
    ckpts = Path(cfg.out_dir) / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000004"]
    assert read_run_state(ckpts / "step_000002").version == 2
    assert (ckpts / "step_000002" / "ema" / "model.safetensors").is_file()
    resumed = _config(tiny_model_dir, tmp_path / "resumed", "--max-steps", "4", "--resume",
                      str(ckpts / "step_000002"), *ppo)
    rows = _run(resumed)
    assert [(r["step"], r["version"]) for r in rows] == [(3, 3), (4, 4)]
    assert [r["lr"] for r in rows] == pytest.approx(lrs[2:])
    assert read_run_state(Path(resumed.out_dir) / "checkpoints" / "step_000004").version == 4

