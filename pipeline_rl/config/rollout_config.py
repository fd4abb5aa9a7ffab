"""``--rollout.*``: the rollout workers and their vLLM engines (sampling, engine kind, how weights
reach them, KV cache, standbys). A section of :class:`pipeline_rl.config.Config`, in a module of its
own like ``lora_config.py``; it imports no torch, vLLM or Ray.

Invariants: a forced ``weight_path`` this machine cannot run is refused while the configuration is
validated (its row's refusal in ``weight_sync/channels/path_table.py``), before anything starts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from pipeline_rl.config_section import Section
from pipeline_rl.weight_sync.channels.path_table import WeightPath, choice_traits

KVPolicy = Literal["keep", "recompute"]


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
        "(bfloat16 on CPU gives a realistic generator/trainer mismatch; it is fast only on a CPU "
        "with avx512_bf16 or amx_bf16, about 3x slower than float32 without, as the run says at start).")
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
