"""Where a trainer step's time goes, and how near the core's matmul rate it runs.

The real trainer (:class:`benchmarks.local.LocalPipeline`'s: DeepSpeed, one rank, one thread)
steps on batches of the run's shape: the task's own prompts rendered and tokenized as the
workers do, ``rollout.n`` completions each whose lengths are ``round(U(0.3, 1.3) x
max_new_tokens)`` clipped to ``[1, max_new_tokens]`` (about 30% truncated, mean about 0.75 of
the budget: the word-problems run's shape), random token ids. Reported:

- ``step_s``: the median ``Trainer.step`` over ``--steps`` steps (after 2 warm-up steps);
- one more step under ``torch.profiler``, its CPU time by kind: matmuls (``aten::mm``,
  ``addmm``, ``bmm``: their FLOPs and rate), attention, the optimizer, the rest
  (element-wise work: norms, activations, the vocabulary-wide log-softmax, copies);
- ``matmul_gflops``: a dense fp32 (or the trainer's dtype) matmul on this core, measured
  in the same process, at the model's MLP shape and at 1024^3 (the better is the bound);
- ``trained_gflops``: FLOPs of the tokens trained per second of step (``6 N`` per real
  token for full fine-tuning, ``4 N`` with LoRA: no weight gradients of the frozen base;
  ``N`` the parameters of the matmuls: every linear layer and the LM head), and that over
  the matmul bound: the step's distance to what the core can do.

Usage: ``python -m benchmarks.trainer_profile [--steps 5] [--json PATH] [-- RUN FLAGS]``
(e.g. ``-- --model smollm2-135m-instruct --task.name word_problems [--lora.rank 16]``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import closing
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.common import Outcome, at_least, config, hardware, main as bench_main
from benchmarks.local import LocalPipeline

if TYPE_CHECKING:
    from pipeline_rl.config import Config
    from pipeline_rl.samples import Group

_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm")
_ATTENTION = "scaled_dot_product"
_OPTIMIZER = ("aten::_fused_adamw_", "aten::_fused_adam_", "aten::_foreach_")


@dataclass(frozen=True, slots=True)
class Profile:
    """One profiled step's CPU time by kind (seconds) and its matmul FLOPs."""

    total_s: float
    matmul_s: float
    matmul_gflop: float
    attention_s: float
    optimizer_s: float

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - self.matmul_s - self.attention_s - self.optimizer_s)


def run_shaped_groups(cfg: Config, tok: Any, task: Any, seed: int, version: int) -> list[Group]:
    """``groups_per_step`` groups of the run's shape (module docstring), from the model's
    tokenizer ``tok`` and the run's ``task`` (each loaded once per measurement)."""
    from pipeline_rl.samples import Completion, Group

    rng = np.random.default_rng(seed)
    budget, vocab = cfg.rollout.max_new_tokens, int(tok.vocab_size)
    groups = []
    for g in range(cfg.groups_per_step):
        p = task.prompt(seed * cfg.groups_per_step + g)
        prompt = np.asarray(tok.encode(p.text, add_special_tokens=not p.templated), dtype=np.int32)
        comps = []
        for c in range(cfg.rollout.n):
            t = int(np.clip(round(rng.uniform(0.3, 1.3) * budget), 1, budget))
            comps.append(Completion(rng.integers(3, vocab, t, dtype=np.int32), -rng.uniform(0.1, 3.0, t).astype(np.float32),
                                    np.full(t, version, np.int32), float(c % 2), "length" if t == budget else "stop"))
        groups.append(Group(seed * 1000 + g, seed * 1000 + g, 0, prompt, tuple(comps)))
    return groups


def matmul_gflops(rows: int, hidden: int, inner: int, dtype: Any, reps: int = 5) -> float:
    """Best GFLOP/s of ``[rows, hidden] @ [hidden, inner]`` over ``reps`` (one warm-up)."""
    import torch

    a, b = torch.randn(rows, hidden, dtype=dtype), torch.randn(hidden, inner, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * rows * hidden * inner / best / 1e9


def profiled_step(trainer: Any, groups: list[Group]) -> Profile:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True) as prof:
        trainer.step(groups)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    mm = [e for e in events if e.key in _MATMUL]
    return Profile(total_s=total, matmul_s=sum(e.self_cpu_time_total for e in mm) / 1e6,
                   matmul_gflop=sum(e.flops for e in mm) / 1e9,
                   attention_s=sum(e.self_cpu_time_total for e in events if _ATTENTION in e.key) / 1e6,
                   optimizer_s=sum(e.self_cpu_time_total for e in events if e.key.startswith(_OPTIMIZER)) / 1e6)


def matmul_params(model: Any) -> int:
    """Parameters that take part in a matmul per token: every linear layer's weight and the
    LM head (tied or not), not the input embedding's lookup."""
    import torch

    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return int(linear)


def measure(cfg: Config, model_dir: str, steps: int) -> dict[str, Any]:
    import torch

    lora = cfg.lora is not None
    from transformers import AutoTokenizer

    from pipeline_rl.tasks.build import build_task_for_model

    tok = AutoTokenizer.from_pretrained(model_dir)
    task = build_task_for_model(cfg.task, model_dir, seed=cfg.seed)
    times, real_tokens = [], []
    with closing(LocalPipeline(cfg, model_dir=model_dir, trainer_threads=1)) as local:
        trainer = local.trainer
        for i in range(steps + 2):
            groups = run_shaped_groups(cfg, tok, task, i, trainer.version)
            t = time.perf_counter()
            r = trainer.step(groups)
            if i >= 2:
                times.append(time.perf_counter() - t)
                real_tokens.append(sum(g.prompt_ids.shape[0] for g in groups) + r.num_tokens)
        prof = profiled_step(trainer, run_shaped_groups(cfg, tok, task, steps + 2, trainer.version))
        base = getattr(trainer.model, "get_base_model", lambda: trainer.model)()
        n = matmul_params(base)
        hidden = int(base.config.hidden_size)
        inner = int(getattr(base.config, "intermediate_size", 4 * hidden))
    dtype = getattr(torch, cfg.model.trainer_dtype("cpu"))
    bound = max(matmul_gflops(512, hidden, inner, dtype), matmul_gflops(1024, 1024, 1024, dtype))
    step = statistics.median(times)
    per_token = (4 if lora else 6) * n
    trained = per_token * statistics.median(real_tokens) / step / 1e9
    return {"hardware": hardware(), "lora": lora, "dtype": str(dtype).removeprefix("torch."), "steps": steps,
            "step_s": round(step, 3), "step_s_all": [round(x, 3) for x in times],
            "real_tokens_median": statistics.median(real_tokens), "matmul_params": n,
            "profile": asdict(prof) | {"other_s": prof.other_s},
            "profiled_matmul_gflops": round(prof.matmul_gflop / max(prof.matmul_s, 1e-9), 1),
            "matmul_gflops": round(bound, 1), "trained_gflops": round(trained, 1),
            "trained_over_matmul": round(trained / bound, 3)}


def markdown(r: dict[str, Any]) -> str:
    p, hw = r["profile"], r["hardware"]
    kind = "LoRA" if r["lora"] else "full"
    share = {k: p[k] / p["total_s"] for k in ("matmul_s", "attention_s", "optimizer_s", "other_s")}
    return "\n".join([
        f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, no GPU; one thread, {r['dtype']}.",
        "", f"| {kind} trainer step | figure |", "|---|---:|",
        f"| step, median of {r['steps']} (s) | {r['step_s']} |",
        f"| real tokens per step (prompts once, completions) | {r['real_tokens_median']} |",
        f"| matmul share of the profiled step | {share['matmul_s']:.1%} ({r['profiled_matmul_gflops']} GFLOP/s) |",
        f"| attention / optimizer / element-wise and the rest | {share['attention_s']:.1%} / "
        f"{share['optimizer_s']:.1%} / {share['other_s']:.1%} |",
        f"| dense matmul on this core (GFLOP/s) | {r['matmul_gflops']} |",
        f"| FLOP/s of the tokens trained (GFLOP/s) | {r['trained_gflops']} |",
        f"| **tokens trained over the matmul rate** | **{r['trained_over_matmul']:.2f}** |"])


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=5, help="Timed steps after 2 warm-up steps (default 5).")


def run(args: argparse.Namespace) -> Outcome:
    at_least(args, steps=1)
    from pipeline_rl.driver import resolve_model_dir

    cfg = config(list(args.run_flags))
    res = measure(cfg, str(resolve_model_dir(cfg)), args.steps)
    return Outcome(res, markdown(res))


def main(argv: list[str] | None = None) -> int:
    return bench_main("trainer_profile", __doc__, argv, run, flags=flags,
                      run_flags="Flags of launch/async_grpo.py, after -- (the model, LoRA, the task).")


if __name__ == "__main__":
    raise SystemExit(main())
