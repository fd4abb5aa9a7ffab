"""One run of TRL's ``GRPOTrainer`` on a pipeline_rl task and model folder: the
synchronous baseline ``python -m benchmarks.peers`` measures the project against.

It trains exactly what ``launch/async_grpo.py`` would with the same flags: the same
model folder, the same prompts in the same order (the task's training split, prompt
ids 0, 1, 2, ...), the same reward function (the task's own, on the completion
text), ``--prompts`` prompts x ``--n`` completions per step, AdamW at a constant
``--lr`` without weight decay, gradient norm clipped at 1, sampling at
``--temperature`` with top-p 1, at most ``--max-new-tokens`` new tokens, group
mean/std advantages, a token-normalised loss over the batch (TRL's ``dapo``, the
project's ``--algorithm.normalization token``), no KL term, one optimizer step per
batch. Generation is Hugging Face ``generate`` (TRL without vLLM); the process uses
``--threads`` torch threads (2 on a 2-core machine: TRL has one process to give them).

Each step appends a JSON line to ``--out``: ``step``, ``unix_time_s`` (wall clock at
the step's end, held-out evaluation taken out), ``time_s`` (since training started, as in the project's
``metrics.jsonl``, held-out evaluation taken out), ``reward_mean``, ``completion_len_mean``
(tokens), ``step_time_s``.

With ``--eval-every E`` the run is also evaluated as the project's runs are: greedy answers
to the first ``--eval-prompts`` prompts of the task's held-out split (the same prompts, the
same reward) before the first step, every ``E`` steps and after the last, by Hugging Face
``generate`` in batches, each appended to ``--eval-out`` as the project's ``eval.jsonl`` rows
are (``step``, ``time_s``: training time at that step, ``greedy_accuracy``, ``eval_s``). The
evaluation's own time is left out of ``time_s``: TRL is timed on training alone.
Needs ``trl``: ``benchmarks.peers`` runs it in TRL's own environment (``benchmarks/peers_env.py``:
TRL's pins and pydantic, for the task code it reads from ``pipeline_rl``); ``pip install -e
'.[peers]'`` adds TRL to the project's.

Usage: ``python -m benchmarks.peers_trl --model DIR --out FILE.jsonl [--seed 0]
[--max-steps 200] [--task sort]``; ``--json``/``--md`` report the run's steps and last reward.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import BadFlag, Outcome, config, main as bench_main


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model folder.")
    p.add_argument("--out", type=Path, required=True, help="Per-step JSON lines go here.")
    p.add_argument("--task", default="sort", help="pipeline_rl task (--task.name), default sort.")
    p.add_argument("--task-flags", default="", help="Further pipeline_rl --task.* flags, space separated.")
    p.add_argument("--seed", type=int, default=0, help="Seed of TRL and of the task's prompts (default 0).")
    p.add_argument("--max-steps", type=int, default=200, help="Optimizer steps (default 200).")
    p.add_argument("--prompts", type=int, default=4, help="Prompts per step (default 4).")
    p.add_argument("--n", type=int, default=8, help="Completions per prompt (default 8).")
    p.add_argument("--lr", type=float, default=2e-4, help="Constant learning rate (default 2e-4).")
    p.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature (default 1).")
    p.add_argument("--max-new-tokens", type=int, default=16, help="Completion limit (default 16).")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2).")
    p.add_argument("--eval-every", type=int, default=0, help="Held-out greedy evaluation every N steps, at "
                   "the start and at the end (default 0: none).")
    p.add_argument("--eval-prompts", type=int, default=32, help="Held-out prompts per evaluation (default 32).")
    p.add_argument("--eval-out", type=Path, default=None, help="Evaluation rows go here (default: eval.jsonl "
                   "beside --out).")


def task_and_prompts(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    """The pipeline's task as its rollout workers build it, and the prompts
    (:class:`pipeline_rl.tasks.base.Prompt`) of ``max_steps`` steps in the order a single
    worker draws them."""
    from pipeline_rl.tasks.build import build_task_for_model

    cfg = config(["--task.name", args.task, *args.task_flags.split(), "--seed", str(args.seed),
                  "--model.path", args.model])
    task = build_task_for_model(cfg.task, args.model, seed=args.seed)
    return task, [task.prompt(i) for i in range(args.max_steps * args.prompts)]


def held_out(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    """The task's held-out split as the project's evaluation builds it, and its first
    ``--eval-prompts`` prompts (ids 0, 1, ...: the ids the project's evaluation asks for)."""
    from pipeline_rl.tasks.build import build_task_for_model

    cfg = config(["--task.name", args.task, *args.task_flags.split(), "--seed", str(args.seed),
                  "--model.path", args.model, "--eval.num_prompts", str(args.eval_prompts)])
    task = build_task_for_model(cfg.task, args.model, seed=args.seed, split="eval", evaluation=cfg.eval)
    count = min(args.eval_prompts, getattr(task, "num_prompts", args.eval_prompts))
    return task, [task.prompt(i) for i in range(count)]


def greedy_accuracy(model: Any, tokenizer: Any, task: Any, prompts: list[Any], max_new_tokens: int,
                    batch: int = 16) -> float:
    """Mean reward of greedy answers to ``prompts`` (left-padded batches of ``batch``)."""
    import torch

    was_training = model.training
    model.eval()
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    total = 0.0
    try:
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            enc = tokenizer([p.text for p in chunk], return_tensors="pt", padding=True,
                            add_special_tokens=not getattr(chunk[0], "templated", False))
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            total += sum(float(task.reward(p.text, t, p)) for p, t in zip(chunk, texts))
    finally:
        tokenizer.padding_side = side
        if was_training:
            model.train()
    return total / max(1, len(prompts))


def run(args: argparse.Namespace) -> Outcome:
    import torch

    torch.set_num_threads(args.threads)
    try:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise BadFlag(f"{e}; install the baseline with: pip install -e '.[peers]'") from None

    task, prompts = task_and_prompts(args)
    by_id = {p.prompt_id: p for p in prompts}
    rows = [{"prompt": p.text, "prompt_id": p.prompt_id} for p in prompts]

    def reward(prompts: list[str], completions: list[str], prompt_id: list[int],
               **_: Any) -> list[float | None]:
        return [float(task.reward(p, c, by_id[i])) for p, c, i in zip(prompts, completions, prompt_id)]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    eval_out: Path = args.eval_out or out.with_name("eval.jsonl")
    eval_task, eval_prompts = held_out(args) if args.eval_every > 0 else (None, [])
    if args.eval_every > 0:
        eval_out.write_text("")

    class StepLog(TrainerCallback):  # type: ignore[misc]
        start = last = time.time()
        eval_s = 0.0   # held-out evaluation time so far, left out of time_s

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            logs = kwargs.get("logs")
            if not logs or "reward" not in logs:
                return
            now = time.time()
            row = {"step": state.global_step, "unix_time_s": now - StepLog.eval_s,
                   "time_s": now - StepLog.start - StepLog.eval_s,
                   "reward_mean": logs["reward"],
                   "completion_len_mean": logs.get("completions/mean_length", float("nan")),
                   "step_time_s": now - StepLog.last}
            StepLog.last = now
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")

        def _evaluate(self, step: int) -> None:
            t = time.time()
            acc = greedy_accuracy(model, tokenizer, eval_task, eval_prompts, args_.max_new_tokens)
            took = time.time() - t
            row = {"step": step, "time_s": t - StepLog.start - StepLog.eval_s, "greedy_accuracy": acc,
                   "num_prompts": len(eval_prompts), "eval_s": took,
                   "unix_time_s": t - StepLog.eval_s}   # wall clock, earlier evaluations left out
            StepLog.eval_s += took
            StepLog.last += took
            with eval_out.open("a") as f:
                f.write(json.dumps(row) + "\n")

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if args_.eval_every > 0:
                self._evaluate(0)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step = state.global_step
            if args_.eval_every > 0 and (step % args_.eval_every == 0 or step == args_.max_steps):
                self._evaluate(step)

    args_ = args

    with tempfile.TemporaryDirectory(prefix="trl-") as scratch:
        config = GRPOConfig(
            output_dir=scratch, max_steps=args.max_steps, seed=args.seed, data_seed=args.seed,
            per_device_train_batch_size=args.prompts * args.n, num_generations=args.n,
            gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
            max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=1.0,
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, beta=0.0, loss_type="dapo",
            scale_rewards="group", shuffle_dataset=False, use_vllm=False, use_cpu=True, bf16=False,
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
            dataloader_num_workers=0, remove_unused_columns=False)
        trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config,
                              train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                              callbacks=[StepLog()])
        StepLog.start = StepLog.last = time.time()
        trainer.train()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    last = rows[-1]["reward_mean"] if rows else float("nan")
    return Outcome({"steps": len(rows), "reward_last": last}, f"peers_trl: {len(rows)} steps, last reward {last:.3f}")


def main(argv: list[str] | None = None) -> int:
    return bench_main("peers_trl", __doc__, argv, run, flags=flags)


if __name__ == "__main__":
    raise SystemExit(main())
