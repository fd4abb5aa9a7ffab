"""What the user sees of a run: per-step metrics, a live progress line, a summary.

One :class:`StepMetrics` per optimizer step is appended as one JSON line to
``OUT_DIR/metrics.jsonl`` (the file is the run's record; it is flushed every
step so a killed run keeps what it logged), mirrored to TensorBoard
(``OUT_DIR/tb``) and to Weights & Biases when ``wandb`` is installed and
``WANDB_PROJECT`` is set. Held-out evaluations (:class:`EvalMetrics`) go the same
ways, to ``OUT_DIR/eval.jsonl`` and under ``eval/`` in TensorBoard. Nothing here
imports torch at module import.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """The metrics of one optimizer step.

    ``version`` is the policy version after the step (= step number);
    ``time_s`` seconds since the run started; ``lag_*`` over the groups of the
    step's batch (trainer version before the step minus oldest token version);
    ``mixed_version_frac``: fraction of the batch's completions whose tokens
    come from two or more policy versions; ``trainer_idle_frac``: the share of
    this step's wall time the trainer spent waiting for a batch;
    ``tokens_per_s`` and ``weight_update_stall_ms`` (mean time a rollout worker's
    engine stood still per weight update) are the workers' figures over the last
    completed statistics window (polled at most every 0.25 s, so several short
    steps share one window), and ``buffer_fill`` and ``evicted`` the buffer's last
    snapshot; ``evicted``: groups dropped as stale so far (cumulative); ``entropy``: the policy's
    per-token entropy on the batch's sampled tokens (mean ``-log π``, nats; a collapse
    towards 0 means the policy stopped exploring); ``weight_sync_ms``: the mean
    :class:`WeightSyncLatency` of the versions every worker reached in the last window;
    ``reward_errors`` / ``reward_timeouts``: completions scored 0 so far because their reward
    failed (raised, returned a non-number) / timed out (cumulative, all workers);
    ``reward_s``: the mean duration of a reward call and ``reward_busy_frac`` the share of
    the workers' time with a reward call in flight, over the last window;
    ``reward_unscored``: completions a reward gave no score (``None``, TRL's convention),
    scored 0 (cumulative, all workers); ``zero_variance_groups``: groups the buffer dropped
    because their rewards were all equal (``--algorithm.skip_zero_variance``; cumulative).
    ``lr``: the learning rate the step trained with (``--trainer.lr`` times the schedule's
    factor at that step, ``--trainer.lr_schedule``).
    ``extra`` also carries ``generator_idle_frac`` (the share of the last window the workers'
    engines idled on the admission budget) and ``eval_tokens_per_s`` (tokens/s the workers
    generated for held-out evaluations in it, not in ``tokens_per_s``: over the time the
    engines were busy, they generated ``tokens_per_s + eval_tokens_per_s``), and the run's
    totals so far, all workers: ``generated_tokens``, ``generated_eval_tokens`` and
    ``generator_busy_s`` (seconds the engines were not idle on the budget); their differences
    between two rows are the generation over those steps, whatever each window's length.
    A multi-turn run
    adds its turn metrics to ``extra`` (``run/recorder.py``, ``turn_metrics``): ``turns_mean``
    / ``turns_max`` and ``env_s_mean`` / ``env_s_p90`` (seconds an episode spent in its
    environment's calls) over the episodes of the last window; ``tool_calls``, ``tool_errors``,
    ``finish_done`` / ``finish_turns`` / ``finish_length`` / ``finish_env_error`` /
    ``finish_timeout`` (episodes by how they ended), ``env_errors`` and ``env_timeouts``
    (cumulative, all workers); an agent run (``--task.agent``) adds ``agent/NAME`` for each
    number its agent returns beside the reward, averaged over the last window's episodes.
    """

    step: int
    version: int
    time_s: float
    reward_mean: float
    tokens_per_s: float
    lag_mean: float
    lag_max: int
    evicted: int
    mismatch_kl: float
    masked_frac: float
    mixed_version_frac: float
    trainer_idle_frac: float
    weight_update_stall_ms: float
    step_time_s: float
    loss: float
    buffer_fill: int
    completion_len_mean: float
    entropy: float = 0.0
    weight_sync_ms: float = 0.0
    reward_errors: int = 0
    reward_timeouts: int = 0
    reward_s: float = 0.0
    reward_busy_frac: float = 0.0
    reward_unscored: int = 0
    zero_variance_groups: int = 0
    lr: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def as_record(self) -> dict[str, Any]:
        rec = asdict(self)
        extra = rec.pop("extra")
        rec.update(extra)
        return rec


@dataclass(frozen=True, slots=True)
class EvalMetrics:
    """One held-out evaluation (``pipeline_rl.run.evaluations``): launched after ``step``
    at ``version``; answers came from weights ``version_min`` .. ``version_max``;
    ``eval_s``: from launch to the last answer scored (it runs beside training)."""

    step: int
    version: int
    time_s: float
    greedy_accuracy: float
    mean_at_k: float
    pass_at_k: float
    k: int
    num_prompts: int
    version_min: int
    version_max: int
    eval_s: float
    greedy_len_mean: float


def version_span(lo: int, hi: int) -> str:
    """The weight versions that served an evaluation: ``v7``, or ``v6-7`` when they span several."""
    return f"v{lo}" if lo == hi else f"v{lo}-{hi}"


def eval_line(m: EvalMetrics) -> str:
    versions = version_span(m.version_min, m.version_max)
    return (f"eval after step {m.step} ({versions}) | greedy {m.greedy_accuracy:.3f} | "
            f"mean@{m.k} {m.mean_at_k:.3f} | pass@{m.k} {m.pass_at_k:.3f} | "
            f"{m.num_prompts} held-out prompts | {m.eval_s:.1f}s")


#: Record fields that are not curves: TensorBoard's x axis, and the wall clock.
_NOT_SCALARS = frozenset({"step", "unix_time_s"})


class TensorBoardScalars:
    """Scalar curves in a TensorBoard event file under ``log_dir``, written with the
    ``tensorboard`` package's own event writer: importing it takes 0.1-0.15 s (the driver
    does it while the actors start: ``run.ahead.TRAINING``), against ~1 s of a
    core for ``torch.utils.tensorboard`` (it imports torch). One event per call carries
    all of a step's scalars."""

    def __init__(self, log_dir: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(str(log_dir))

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        """``tag -> value`` at ``step``, as one event."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])
        self._writer.add_event(Event(summary=summary, wall_time=time.time(), step=step))

    def add_mark(self, tag: str, count: int, text: str, step: int) -> None:
        """A mark at ``step``: the scalar ``tag + 's'`` (``count``, how many so far) and the text
        ``tag`` (TensorBoard's text tab), as one event."""
        from tensorboard.compat.proto import types_pb2
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        as_text = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        tensor = TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        summary = Summary(value=[Summary.Value(tag=tag + "s", simple_value=float(count)),
                                 Summary.Value(tag=tag, metadata=as_text, tensor=tensor)])
        self._writer.add_event(Event(summary=summary, wall_time=time.time(), step=step))

    def close(self) -> None:
        self._writer.close()


class MetricsLogger:
    """Appends step records to ``metrics.jsonl`` and TensorBoard, prints progress."""

    def __init__(self, out_dir: Path, *, stream: TextIO | None = None, tensorboard: bool = True) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self._file = (out_dir / "metrics.jsonl").open("a", encoding="utf-8")
        self._eval_file = (out_dir / "eval.jsonl").open("a", encoding="utf-8")
        self._stream = stream if stream is not None else sys.stdout  # read at call time
        self._tb = TensorBoardScalars(out_dir / "tb") if tensorboard else None
        self._wandb: Any = None
        if os.environ.get("WANDB_PROJECT"):
            try:
                import wandb  # type: ignore[import-not-found]

                self._wandb = wandb.init(dir=str(out_dir))
            except ImportError:
                self._wandb = None

    def log(self, m: StepMetrics) -> None:
        rec = m.as_record()
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tb.add_scalars({key: value for key, value in rec.items()
                                  if isinstance(value, (int, float)) and key not in _NOT_SCALARS}, m.step)
        if self._wandb is not None:
            self._wandb.log(rec, step=m.step)
        self._stream.write(progress_line(m) + "\n")
        self._stream.flush()

    def log_eval(self, m: EvalMetrics) -> None:
        rec = asdict(m)
        self._eval_file.write(json.dumps(rec) + "\n")
        self._eval_file.flush()
        if self._tb is not None:
            self._tb.add_scalars({f"eval/{key}": rec[key] for key in
                                  ("greedy_accuracy", "mean_at_k", "pass_at_k", "greedy_len_mean", "eval_s")}, m.step)
        if self._wandb is not None:
            self._wandb.log({f"eval/{k}": v for k, v in rec.items()}, step=m.step)
        self._stream.write(eval_line(m) + "\n")
        self._stream.flush()

    def log_resume(self, number: int, step: int, line: str) -> None:
        """Mark the run's ``number``-th resume, at ``step``, in TensorBoard (``run/resumes``,
        ``run/resume``); ``resumes.jsonl`` holds it already (``run.run_folder``)."""
        if self._tb is not None:
            self._tb.add_mark("run/resume", number, line, step)

    def close(self) -> None:
        """Flush and close every sink (idempotent)."""
        if self._file.closed:
            return
        self._file.close()
        self._eval_file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def progress_line(m: StepMetrics) -> str:
    """One line per step: step, reward, tokens/s, lag, buffer fill, mismatch KL; the reward
    failures so far, once there are any."""
    failed = (f" | reward errors {m.reward_errors + m.reward_timeouts}"
              f"{f' ({m.reward_timeouts} timed out)' if m.reward_timeouts else ''}"
              if m.reward_errors or m.reward_timeouts else "")
    failed += f" | skip {m.zero_variance_groups}" if m.zero_variance_groups else ""
    return (f"step {m.step:4d} | reward {m.reward_mean:.3f} | {m.tokens_per_s:7.0f} tok/s | "
            f"lag {m.lag_mean:.2f} (max {m.lag_max}) | buffer {m.buffer_fill:3d} | "
            f"kl {m.mismatch_kl:+.1e} | ent {m.entropy:.2f} | mixed {m.mixed_version_frac:.2f} | "
            f"idle {m.trainer_idle_frac:.2f} | {m.time_s:6.1f}s{failed}{turns_part(m.extra)}")


def turns_part(x: dict[str, float]) -> str:
    """The step line's turn metrics (multi-turn runs), each only when non-zero: turns per
    episode, environment seconds, tool calls (errors), environment errors and timeouts so far."""
    parts = []
    if x.get("turns_mean"):
        parts.append(f"turns {x['turns_mean']:.2f} (max {x['turns_max']:.0f})")
    if x.get("env_s_mean"):
        parts.append(f"env {x['env_s_mean']:.3f}s (p90 {x['env_s_p90']:.3f})")
    if x.get("tool_calls"):
        parts.append(f"tools {x['tool_calls']:.0f}" + (f" ({x['tool_errors']:.0f} failed)" if x.get("tool_errors") else ""))
    if x.get("env_errors") or x.get("env_timeouts"):
        parts.append(f"env errors {x.get('env_errors', 0):.0f} / timeouts {x.get('env_timeouts', 0):.0f}")
    return "".join(f" | {p}" for p in parts)


def turn_rows(history: Sequence[StepMetrics]) -> list[tuple[str, str]]:
    """The summary's turn metrics (a multi-turn run): turns and environment seconds over
    its steps, and its counts at the end."""
    steps = [m.extra for m in history if "turns_mean" in m.extra]
    if not steps:
        return []
    last = history[-1].extra
    ends = ", ".join(f"{k.removeprefix('finish_')} {last.get(k, 0):.0f}"
                     for k in ("finish_done", "finish_turns", "finish_length", "finish_env_error", "finish_timeout"))
    return [
        ("turns per episode (mean / max)", f"{statistics.fmean(x['turns_mean'] for x in steps):.2f} / "
                                           f"{max(x['turns_max'] for x in steps):.0f}"),
        ("environment seconds per episode (mean / p90 of steps)",
         f"{statistics.fmean(x['env_s_mean'] for x in steps):.3f} / {max(x['env_s_p90'] for x in steps):.3f}"),
        ("tool calls / failed", f"{last.get('tool_calls', 0):.0f} / {last.get('tool_errors', 0):.0f}"),
        ("episodes by end", ends),
        ("environment errors / timeouts", f"{last.get('env_errors', 0):.0f} / {last.get('env_timeouts', 0):.0f}"),
    ]


def summary_table(history: Sequence[StepMetrics], evals: Sequence[EvalMetrics] = (),
                  sync_ms: Sequence[float] = ()) -> str:
    """A Markdown table summarising a run (first/last reward, speeds, lag, evictions,
    weight sync, first and last held-out evaluation); ``sync_ms``: every resolved
    :class:`WeightSyncLatency` of the run."""
    if not history:
        return "(no steps completed)"
    first, last = history[0], history[-1]
    k = max(1, len(history) // 10)
    head = statistics.fmean(m.reward_mean for m in history[:k])
    tail = statistics.fmean(m.reward_mean for m in history[-k:])
    step_s = (last.time_s - first.time_s) / max(1, len(history) - 1) if len(history) > 1 else first.time_s
    rows = [
        ("steps", f"{len(history)}"),
        ("wall time", f"{last.time_s:.1f} s"),
        (f"reward (mean of first {k} steps)", f"{head:.3f}"),
        (f"reward (mean of last {k} steps)", f"{tail:.3f}"),
        ("time per step", f"{step_s:.2f} s"),
        ("tokens/s (mean)", f"{statistics.fmean(m.tokens_per_s for m in history):.0f}"),
        ("lag mean / max", f"{statistics.fmean(m.lag_mean for m in history):.2f} / "
                           f"{max(m.lag_max for m in history)}"),
        ("mixed-version samples", f"{statistics.fmean(m.mixed_version_frac for m in history):.3f}"),
        ("evicted groups", f"{last.evicted}"),
        ("trainer idle", f"{statistics.fmean(m.trainer_idle_frac for m in history):.2f}"),
        ("weight-update stall", f"{statistics.fmean(m.weight_update_stall_ms for m in history):.1f} ms"),
        ("reward call (mean) / workers' time in rewards", f"{statistics.fmean(m.reward_s for m in history) * 1e3:.1f} "
                                                          f"ms / {statistics.fmean(m.reward_busy_frac for m in history):.2f}"),
        ("reward errors / timeouts (scored 0)", f"{last.reward_errors} / {last.reward_timeouts}"),
    ]
    if sync_ms:
        rows.append(("weight sync, step end -> every worker on it (p50 / p90)",
                     f"{percentile(sync_ms, 0.5):.1f} / {percentile(sync_ms, 0.9):.1f} ms"))
    rows += turn_rows(history)
    rows += [
        ("entropy of sampled tokens (first / last step)", f"{first.entropy:.3f} / {last.entropy:.3f} nats"),
    ]
    if evals:
        a, b = evals[0], evals[-1]
        span = f"step {a.step} -> {b.step}"
        rows += [(f"held-out greedy accuracy ({span})", f"{a.greedy_accuracy:.3f} -> {b.greedy_accuracy:.3f}"),
                 (f"held-out mean@{b.k} ({span})", f"{a.mean_at_k:.3f} -> {b.mean_at_k:.3f}"),
                 (f"held-out pass@{b.k} ({span})", f"{a.pass_at_k:.3f} -> {b.pass_at_k:.3f}")]
    width = max(len(r[0]) for r in rows)
    lines = [f"| {'metric':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {name:<{width}} | {value} |" for name, value in rows]
    return "\n".join(lines)


class WeightSyncLatency:
    """Weight sync as a user feels it: per published version ``v``, from the trainer's step
    end until *every* worker's engine could sample with ``v`` or newer (a skipped version is
    reached by the next one applied); ``time.time()`` clocks. At most ``keep`` versions and
    ``keep`` applications per worker are held; ``all_ms``: every resolved latency."""

    def __init__(self, workers: int, keep: int = 512) -> None:
        self._keep = keep
        self._pending: dict[int, float] = {}                     # version -> step end
        self._applied: list[dict[int, float]] = [{} for _ in range(workers)]
        self.all_ms: list[float] = []

    def published(self, version: int, step_end_at: float) -> None:
        self._pending[version] = step_end_at
        while len(self._pending) > self._keep:
            del self._pending[min(self._pending)]

    def applied(self, worker: int, version: int, at: float) -> None:
        seen = self._applied[worker]
        seen[version] = min(at, seen.get(version, at))
        while len(seen) > self._keep:
            del seen[min(seen)]

    def resolve(self) -> list[float]:
        """Latencies (ms) of the versions every worker has reached since the last call."""
        done: list[float] = []
        for version in sorted(self._pending):
            reached = [min((t for v, t in seen.items() if v >= version), default=None) for seen in self._applied]
            if any(t is None for t in reached):
                continue
            done.append(max(0.0, (max(t for t in reached if t is not None) - self._pending.pop(version)) * 1e3))
        self.all_ms += done
        return done


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by linear interpolation (nan when empty)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def read_history(path: Path) -> list[StepMetrics]:
    """The steps of a ``metrics.jsonl`` file as :class:`StepMetrics` (fields it does not
    name go to ``extra``); the run's full record, read once at its end for the summary
    instead of being kept in memory step after step."""
    names = set(StepMetrics.__dataclass_fields__) - {"extra"}
    out = []
    for rec in read_metrics(path):
        extra = {k: float(v) for k, v in rec.items() if k not in names and isinstance(v, (int, float))}
        out.append(StepMetrics(**{k: v for k, v in rec.items() if k in names}, extra=extra))
    return out


def read_evals(path: Path) -> list[EvalMetrics]:
    """The evaluations of an ``eval.jsonl`` file (empty when there is none)."""
    if not path.exists():
        return []
    return [EvalMetrics(**rec) for rec in read_metrics(path)]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` file back (one dict per step)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
