"""The Ray driver behind ``launch/async_grpo.py`` (docs/design.md section 8).

Start-up, in order: resolve the model folder (the built-in model is built and
warm-started locally when ``--model.path`` is unset); start or join Ray; start
the replay buffer actor (it binds its ZeroMQ PULL socket on its node's IP);
start the trainer ranks (DeepSpeed, gloo on CPU) and the rollout workers
(vLLM), each with one CPU; hand the workers the buffer's address and the
trainer's first weights; then step.

The loop: every trainer rank takes its share of a batch from the buffer (Ray
call) as soon as the buffer can give one, steps, and rank 0 publishes the new
weights to every worker in the background. The driver logs one
:class:`~pipeline_rl.metrics.StepMetrics` per step and supervises:

- a rollout worker that dies is replaced by its standby or restarted by Ray, up to
  ``--run.max_worker_restarts`` times; the driver
  tells the buffer to refund the dead worker's admission grants (its in-flight
  groups are lost and counted), hands the new worker the newest weights and
  restarts its generation loop; the run goes on;
- a trainer rank or the buffer that dies restarts the run in this process from its
  newest checkpoint (``run/life/``, ``--run.max_restarts``); a failure a restart
  would not heal stops the run with one clear message, naming the checkpoint to resume;
- Ctrl-C (SIGINT) or SIGTERM stops everything: the loop ends, workers stop,
  sockets close, and a local Ray started here is shut down.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType
from typing import Any

from pipeline_rl.config import Config

__all__ = ["check_task", "resolve_model_dir", "run", "startup_line"]

log = logging.getLogger("pipeline_rl.driver")

class _StopFlag:
    """Set by SIGINT/SIGTERM; the main loop polls it between steps."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.event.is_set():  # second Ctrl-C: stop waiting politely
            raise KeyboardInterrupt
        print(f"\nstopping (signal {signum}); Ctrl-C again to force", file=sys.stderr, flush=True)
        self.event.set()


def resolve_model_dir(cfg: Config) -> str:
    """The HF folder the run starts from: a named pretrained model (converted from its package
    once, :mod:`pipeline_rl.models.pretrained`; a missing package is a one-line ValueError),
    ``--model.path`` or the built-in model."""
    from pipeline_rl.models.pretrained import is_pretrained_name, pretrained_model_dir

    if cfg.model.path is not None:
        from pipeline_rl.models.check import check_model_dir

        if is_pretrained_name(cfg.model.path):
            return check_model_dir(str(pretrained_model_dir(cfg.model.path)))
        return check_model_dir(cfg.model.path)
    from pipeline_rl.models import default_model_dir

    return str(default_model_dir(cfg.model, cfg.task))


def startup_line(cfg: Config) -> str:
    """The model and the profile of defaults in force, with the values the run uses:
    ``model: NAME | profile: pretrained (lr 1e-05, kl 0, ...)``, and a LoRA run's adapter and
    serving mode (``| lora: rank 16, ..., serving merged (auto on cpu)``); a ratio objective whose
    one pass against the proximal policy makes it REINFORCE says so (``| loss: ...``)."""
    from pipeline_rl.profiles import PROFILE_KEYS, profile_line

    values = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for _, key in PROFILE_KEYS}
    line = f"model: {cfg.model.path or 'built-in'} | {profile_line(cfg.profile, values)}"
    if cfg.lora is not None:   # the serving mode in force, and why
        import torch

        device = cfg.model.device if cfg.model.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        line += f" | {cfg.lora.startup_text(device)}"
    algo = cfg.algorithm
    if algo.loss != "reinforce" and algo.ratio_reference == "proximal" and algo.ppo_epochs == 1:
        line += (f" | loss: {algo.loss} in one pass against the trainer's own log-probs: its ratio is 1, its "
                 f"gradient REINFORCE's (--algorithm.ppo_epochs 2, or --algorithm.ratio_reference behaviour)")
    return line


def check_task(cfg: Config, model_dir: str) -> Config:
    """Load the task (and its held-out split, when evaluation is on) with the model's
    tokenizer before anything starts: a dataset row without the needed fields, a
    prompt longer than the context leaves room for, an empty ``--eval.dataset``, or a
    ``--task.env`` that names no environment is a one-line error here instead of a crash
    mid-run (or an actor's death).

    Returns the configuration to run, ``cfg`` itself or a copy with ``eval`` adjusted: a
    training dataset too small to give any row to the held-out split turns evaluation off
    (one warning line); ``num_prompts`` is capped at the held-out pool's size."""
    from pipeline_rl.tasks.base import TaskError
    from pipeline_rl.tasks.build import build_task
    from pipeline_rl.tasks.tokenizer import check_tokenizer
    from pipeline_rl.tasks.chat import plugin_reward

    if cfg.task.env is not None:   # a misnamed environment: one line here, not an actor's death
        from pipeline_rl.tasks.env import resolve_env

        resolve_env(cfg.task.env)
    if cfg.task.agent is not None:   # likewise a misnamed agent
        from pipeline_rl.tasks.agent import resolve_agent

        resolve_agent(cfg.task.agent)
    tokenizer = check_tokenizer(cfg.task, model_dir)
    if cfg.task.name == "dataset" and cfg.task.reward is None:
        from pipeline_rl.tasks.math_reward import backend

        log.info("%s", backend())
    limit = cfg.rollout.max_model_len - cfg.rollout.max_new_tokens
    train = build_task(cfg.task, seed=cfg.seed, tokenizer=tokenizer, max_prompt_tokens=limit, evaluation=cfg.eval)
    if not cfg.eval.every:
        return cfg
    try:
        held_out = build_task(cfg.task, seed=cfg.seed, tokenizer=tokenizer, max_prompt_tokens=limit,
                              split="eval", evaluation=cfg.eval, reward_fn=plugin_reward(train))
    except TaskError as e:
        if cfg.task.name != "dataset" or cfg.eval.dataset is not None:
            raise
        log.warning("evaluation off: %s", str(e).splitlines()[0])
        return cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"every": 0})})
    held_out.prompt(0)
    if held_out.num_prompts >= cfg.eval.num_prompts:
        return cfg
    return cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"num_prompts": held_out.num_prompts})})


def _configure_logging(cfg: Config) -> None:
    """info: the project's own messages only (libraries at WARNING), one short line each;
    debug: every logger, with timestamps."""
    if cfg.log_level == "debug":
        logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(name)s: %(message)s",
                            stream=sys.stderr)
        return
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("pipeline_rl").setLevel(logging.INFO)


def run(cfg: Config) -> int:
    """Run a whole training job; returns the process exit status."""
    _configure_logging(cfg)
    from pipeline_rl.run.life import run_life
    from pipeline_rl.run.life.run_folder import resolve_resume
    from pipeline_rl.run.life.start import open_run
    from pipeline_rl.run.life.supervise import OrchestratorError
    from pipeline_rl.tasks.base import TaskError

    for warning in cfg.warnings():
        log.warning("%s", warning)
    try:
        model_dir = resolve_model_dir(cfg)
        if cfg.lora is not None:   # the adapter's modules against the model's, before Ray
            from pipeline_rl.training.lora import check_lora

            check_lora(cfg.lora, model_dir)
        cfg = resolve_resume(check_task(cfg, model_dir))   # --resume RUN_DIR: its newest checkpoint
        folder = open_run(cfg)
    except (TaskError, OSError, ValueError, OrchestratorError) as e:
        print(f"async_grpo.py: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"{folder.line()} | {startup_line(cfg)}", file=sys.stderr, flush=True)   # one line: the console stays short
    stop = _StopFlag()
    stop.install()
    try:
        run_life(cfg, model_dir, stop.event, folder)   # restarts itself (--run.max_restarts)
    except OrchestratorError as e:
        print(f"async_grpo.py: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("async_grpo.py: interrupted", file=sys.stderr)
        return 130
    finally:
        stop.restore()
    return 130 if stop.event.is_set() else 0


