"""Shared test set-up: one thread per process (2-core machines), no Ray token file,
a small KV cache for vLLM on CPU, and helpers to build tiny models locally."""

from __future__ import annotations

import os

from collections.abc import Iterator

import pytest

# Tests run on 2-core machines: one thread per process (docs/design.md, platform notes).
for _key, _value in {
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
    "RAY_AUTH_MODE": "disabled", "DS_ACCELERATOR": "cpu",
    "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
}.items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random-init Llama (hidden 64, 2 heads -> head dim 32, 2 layers) with the
    character tokenizer, built once per test session."""
    from pipeline_rl.models.tiny_llama import build_tiny_model

    out = tmp_path_factory.mktemp("tiny_model")
    build_tiny_model(out, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    return str(out)


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A local Ray (2 CPUs) shared by one test module's pipeline runs; the orchestrator
    joins it instead of starting its own."""
    import ray

    from pipeline_rl.runtime_env import ACTOR_ENV
    from pipeline_rl.run.local_ray import start_local

    start_local(num_cpus=2, object_store_mb=200, env=ACTOR_ENV, logging_level=30, log_to_driver=False)
    yield
    ray.shutdown()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Wait out the trainer halves of gloo channels still joining a worker that died (a
    test's dead peer): such a join waits in torch's C++ for up to its timeout (60 s) with
    the GIL released, and if it wakes while this interpreter is finalizing, pybind11 ends
    the process with SIGABRT after every test passed. Bounded; nothing waits when none is
    left."""
    import threading
    import time

    deadline = time.monotonic() + 70.0
    for t in threading.enumerate():
        if t.daemon and t.name == "join" and t.is_alive():
            t.join(max(0.0, deadline - time.monotonic()))
