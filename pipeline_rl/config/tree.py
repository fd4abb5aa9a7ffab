"""One typed, validated configuration tree for the whole system.

Layers, lowest first: field defaults < TOML file (``--config FILE``) < CLI flags.
Every field's description becomes its ``--help`` text; flags are grouped by
section (``--rollout.n 8``, ``--correction.type icepop``); ``--staleness`` and a
few run-level flags sit at the top level.

Invariants (checked before anything starts; a violation is one line naming the
flag and exits with status 2):
- ``trainer.batch_size`` is a positive multiple of ``rollout.n`` (GRPO needs
  whole groups).
- correction thresholds are ordered (``icepop_alpha < icepop_beta``,
  ``seq_lo < seq_hi``) and caps are > 1.
- on a CPU machine, the model's attention head dimension is one vLLM's CPU
  attention supports.

The larger sections are modules of their own beside this one (``model_config.py``,
``rollout_config.py``, ``algorithm_config.py``, ``trainer_config.py`` with ``optimizer_config.py``,
``correction_config.py``, ``lora_config.py``, ``task_config.py``); this module holds the tree
itself (:class:`Config`), its checks across sections, and the small sections (buffer, run, ray,
eval). The folder's ``__init__.py`` re-exports every section's names: one import for the whole tree.

This module imports no torch, vLLM or Ray, so ``--help`` is instant.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline_rl.config.algorithm_config import AlgorithmConfig
from pipeline_rl.config.config_renames import check_renamed
from pipeline_rl.config_section import Section
from pipeline_rl.config.correction_config import Correction, PresetCorrection, correction_table
from pipeline_rl.config.lora_config import LoraConfig, lora_section
from pipeline_rl.config.model_config import ModelConfig
from pipeline_rl.config.rollout_config import RolloutConfig
from pipeline_rl.tasks.task_config import TaskConfig
from pipeline_rl.config.trainer_config import TrainerConfig
from pipeline_rl.profiles import apply_profile  # stdlib only


class BufferConfig(Section):
    """The replay buffer and its ZeroMQ link."""

    capacity_groups: int = Field(256, ge=1, le=1_000_000, description="Buffer capacity in groups; "
                                 "a full buffer blocks producers.")
    address: str | None = Field(None, description="ZeroMQ bind address (tcp://HOST:PORT or "
                                "ipc://PATH). Unset: a free loopback TCP port.")
    max_message_mb: float = Field(64.0, gt=0.0, le=2048.0, description="Largest accepted message.")
    send_timeout_s: float = Field(60.0, gt=0.0, description="A producer blocked this long by a full "
                                  "buffer raises instead of waiting forever.")


class RunConfig(Section):
    """How the run heals itself (docs/failures.md): both restart limits, the whole run's and a
    rollout worker's."""

    max_restarts: int = Field(3, ge=0, le=1000, description="When a trainer rank or the replay buffer dies "
                              "(its process killed, out of memory, a Ray actor death) or a weight update "
                              "fails, the run stops what is left and starts again in the same process "
                              "from its newest complete checkpoint; this many restarts in a row without "
                              "a step in between end the run (0 = never restart).")
    spare_trainers: bool = Field(True, description="Keep a spare process per trainer rank, its imports "
                                 "done at low priority beside the run, that a restart takes instead of a "
                                 "new process (whose imports took 7 s of a restart's 8 s on 2 cores; the "
                                 "rollout workers are kept across a restart as they are). CPU runs with "
                                 "--run.max_restarts above 0 only: on GPUs a spare would need its own GPU.")
    max_worker_restarts: int = Field(3, ge=0, le=1000, description="Times a rollout worker whose process "
                                 "died is replaced (by its standby, or the process Ray restarts) before "
                                 "the run ends; the run itself is not restarted for it (an exception "
                                 "inside a worker ends the run at once).")


class RayConfig(Section):
    """Ray placement."""

    address: str | None = Field(None, description="Join an existing cluster (e.g. auto or "
                                "HOST:6379); RAY_ADDRESS, as `ray job submit` sets it, does the same. "
                                "Unset: start a private local Ray (never another cluster on the machine).")
    num_cpus: int | None = Field(None, ge=1, description="CPUs for a local Ray (default: all).")
    object_store_mb: int = Field(200, ge=64, description="Object store size for a local Ray (MiB).")
    pin_cores: bool | None = Field(None, description="On one machine with a core for every rollout worker "
                                   "and trainer rank (CPU runs), give each its own core (CPU affinity); the "
                                   "buffer, the driver and Ray float. Unset: only on a Ray this run starts "
                                   "itself (never on a cluster it joins, where another run may hold the same "
                                   "cores); true: on a joined one-node cluster too; false: never. With fewer "
                                   "cores nothing is pinned.")
    rollout_resource: str | None = Field(None, description="Custom Ray resource every rollout worker "
                                         "needs (places workers on the nodes that declare it).")
    trainer_resource: str | None = Field(None, description="Custom Ray resource every trainer rank "
                                         "needs (places trainers on the nodes that declare it).")


class EvalConfig(Section):
    """Held-out evaluation beside training, on the rollout workers' vLLM engines with the current
    weights (no extra model copy); the default size costs the default run <= 1.1x its time to 0.8."""

    every: int = Field(50, ge=0, description="Evaluate every N steps, at the start and at the end (0 = never).")
    num_prompts: int = Field(32, ge=1, le=100_000, description="Held-out prompts per evaluation "
                             "(the same ones each time).")
    k: int = Field(2, ge=1, le=1024, description="Samples per prompt at rollout.temperature for "
                   "mean@k and pass@k (greedy accuracy uses one greedy sample).")
    dataset: str | None = Field(None, description="Held-out prompts from this data file (fields as "
                                "--task.prompt_field/--task.answer_field). Default: built-in tasks "
                                "hold out 5% of their prompt texts; a training dataset gives 5% of its "
                                "rows (by a hash of the prompt) to evaluation and trains on the rest.")


class Config(Section):
    """The whole run."""

    staleness: int = Field(2, ge=0, le=1_000_000, description="Largest lag (trainer version - "
                           "oldest token version) a trained sample may have; 0 = synchronous.")
    max_steps: int = Field(400, ge=1, description="Optimizer steps to run.")
    out_dir: str | None = Field(None, description="The run's folder (metrics, evaluations, TensorBoard "
                                "logs, actor logs, checkpoints); it must not hold another run. Unset: a "
                                "new runs/<date>-<time>, with runs/latest pointing at it (a --resume "
                                "continues in its checkpoint's run folder).")
    seed: int = Field(0, ge=0, description="Random seed.")
    resume: str | None = Field(None, description="Checkpoint folder to resume from, or a run folder "
                                "(its newest complete checkpoint).")
    log_level: Literal["info", "debug"] = Field(
        "info", description="info: one line per start-up phase, the step lines and the summary on "
        "the console; the actors' own output (vLLM, DeepSpeed, Ray workers) goes to "
        "OUT_DIR/logs/. debug: everything on the console.")
    watchdog_s: float = Field(120.0, ge=0.0, description="End the run, saying who waits for what, "
                              "when no step completes within max(this, 20 x the median step time) "
                              "seconds (0 = off).")
    profile: Literal["auto", "builtin", "pretrained"] = Field("auto", description="Defaults of lr, KL, "
        "temperature, lengths and watchdog where no flag sets them: builtin (the field defaults) or pretrained "
        "(lr 2e-5, kl 0, temperature 1, 32 new tokens, context 512, watchdog 600 s). auto: pretrained when "
        "--model is a pretrained model (named, or any folder but the built-in model's), else builtin.")
    fault: str | None = Field(None, description="Failure tests: make one actor raise at POINT@VERSION "
                              "(weight_update, engine_step, trainer_step, buffer, engine_hang, "
                              "engine_start; checkpoint_write: a trainer killed mid-save; trainer_kill, "
                              "buffer_kill: that process killed) once the policy reaches VERSION.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    correction: Correction = Field(default_factory=PresetCorrection, description="Off-policy correction: a "
                                   "preset with its knobs, or custom with its composition (docs/objectives.md).")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    lora: LoraConfig | None = Field(None, description="A LoRA adapter instead of every weight: on with "
                                    "--lora.rank above 0 (None: full fine-tuning).")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="before")
    @classmethod
    def _profile_defaults(cls, data: object) -> object:   # before the fields: a flag wins (profiles.py)
        if isinstance(data, dict):
            check_renamed(data)   # an old key is one line naming the new one (config_renames.py)
        return apply_profile(data) if isinstance(data, dict) else data

    @field_validator("correction", mode="before")
    @classmethod
    def _correction_table(cls, v: object) -> object:   # no type: tis's (correction_config.py)
        return correction_table(v)

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_section(cls, v: object) -> object:   # rank 0 or none: no section (lora_config.py)
        return lora_section(v)

    @field_validator("fault")
    @classmethod
    def _fault_spec(cls, spec: str | None) -> str | None:
        if spec is not None:
            from pipeline_rl.faults import check_fault_spec  # torch-free, stdlib only

            check_fault_spec(spec)
        return spec

    @model_validator(mode="after")
    def _cross_checks(self) -> "Config":
        if self.trainer.batch_size % self.rollout.n:
            raise ValueError(f"trainer.batch_size: must be a multiple of rollout.n={self.rollout.n} "
                             f"(got {self.trainer.batch_size})")
        if (self.trainer.batch_size // self.rollout.n) % self.trainer.num_ranks:
            raise ValueError(f"trainer.batch_size: groups per step ({self.trainer.batch_size // self.rollout.n}) "
                             f"must divide evenly over trainer.num_ranks={self.trainer.num_ranks}")
        if self.rollout.engine == "inprocess" and self.model.device == "cuda":
            raise ValueError("rollout.engine: inprocess runs on CPU only; use async (or auto) "
                             "with model.device cuda")
        if self.trainer.warmup_steps >= self.max_steps and self.trainer.warmup_steps > 0:
            raise ValueError(f"trainer.warmup_steps: must be below max_steps={self.max_steps} "
                             f"(got {self.trainer.warmup_steps})")
        if self.trainer.ema_decay > 0 and self.trainer.zero_stage == 3:
            raise ValueError("trainer.ema_decay: the moving average is kept of whole parameters, which "
                             "ZeRO-3 partitions over ranks; use --trainer.zero_stage 0-2 with it")
        if self.task.name == "word_problems" and self.model.path is None:
            raise ValueError("task.name: word_problems is English for a pretrained chat model; give one "
                             "with --model (e.g. --model smollm2-135m-instruct)")
        return self

    @property
    def groups_per_step(self) -> int:
        return self.trainer.batch_size // self.rollout.n

    def warnings(self) -> list[str]:
        """Settings that are valid but probably not meant (one line each; the driver
        prints them at start)."""
        out = []
        algo = self.algorithm
        if algo.normalization == "constant" and algo.constant_length > 4 * self.rollout.max_new_tokens:
            out.append(f"--algorithm.constant_length {algo.constant_length} is "
                       f"{algo.constant_length / self.rollout.max_new_tokens:.0f}x "
                       f"--rollout.max_new_tokens {self.rollout.max_new_tokens}: with constant "
                       f"normalisation the gradient shrinks by about that factor")
        if self.task.name == "countdown":
            from pipeline_rl.tasks.builtin import countdown_answer_tokens

            longest = countdown_answer_tokens(self.task.digits)
            if self.rollout.max_new_tokens < longest:
                out.append(f"--rollout.max_new_tokens {self.rollout.max_new_tokens} cuts countdown answers "
                           f"of up to {longest} tokens (a cut answer scores 0)")
        return out
