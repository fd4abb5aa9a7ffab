"""The flags of a tiny end-to-end run (2 groups of 4 completions per step), shared
by the tests that start the real pipeline on the session's tiny model."""

from __future__ import annotations

from pathlib import Path

from pipeline_rl.cli import parse_config
from pipeline_rl.config import Config

#: 2 groups of 4 completions per step, 24 new tokens, a generous batch timeout for 2 cores;
#: held-out evaluation off (the tests that check it turn it on); no rollout-worker standby and
#: no spare trainer rank (a second vLLM start, a second trainer's imports, on 2 cores beside
#: every short run: the tests of them turn them on).
TINY_RUN_FLAGS: tuple[str, ...] = (
    "--rollout.n", "4", "--trainer.batch_size", "8", "--trainer.micro_batch_size", "8",
    "--rollout.max_new_tokens", "24", "--rollout.max_num_seqs", "16", "--trainer.batch_timeout_s", "120",
    "--eval.every", "0", "--rollout.standby", "false", "--run.spare_trainers", "false")


def tiny_run_config(model_dir: str, out: Path, *extra: str) -> Config:
    """The validated config of a tiny run of ``model_dir`` writing to ``out``; ``extra`` flags last."""
    cfg, _ = parse_config(["--model.path", model_dir, "--out-dir", str(out), *TINY_RUN_FLAGS, *extra],
                          check_cpu=True)
    return cfg
