"""A multi-turn tool episode run of a chat model through the whole pipeline (Ray, a vLLM
worker, the DeepSpeed trainer, ZeroMQ): a tiny random Qwen2 model with a ChatML template
(``chat_models.py``), the native tool environment ``tool_envs:AddToolsNudged`` (Hermes
calls read by vLLM's parser, replies as messages through the template), 20 steps; the
metrics carry the turn fields. And agent code (``--task.agent``) through the same pipeline."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from chat_models import build_chat_model
from test_e2e import _run
from tiny_run import tiny_run_config

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def ray_with_tests() -> Iterator[None]:
    """A local Ray whose workers import from tests/ (the environment ``tool_envs``)."""
    import ray

    from pipeline_rl.run.local_ray import start_local
    from pipeline_rl.runtime_env import ACTOR_ENV

    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    start_local(num_cpus=2, object_store_mb=200, env={**ACTOR_ENV, "PYTHONPATH": path}, logging_level=30,
                log_to_driver=False)
    yield
    ray.shutdown()


def test_a_chat_model_runs_twenty_steps_of_tool_episodes(ray_with_tests: None, tmp_path: Path) -> None:
    model = build_chat_model("qwen2", tmp_path / "qwen2-chat")
    cfg = tiny_run_config(str(model), tmp_path / "run", "--max-steps", "20", "--task.name", "addition",
                          "--task.env", "tool_envs:AddToolsNudged", "--task.max_turns", "3",
                          "--rollout.max_model_len", "512", "--rollout.max_new_tokens", "16")
    rows = _run(cfg)
    assert len(rows) == 20
    last = rows[-1]
    for key in ("turns_mean", "turns_max", "env_s_mean", "env_s_p90", "tool_calls", "tool_errors", "finish_done",
                "finish_turns", "finish_length", "finish_env_error", "finish_timeout", "env_errors", "env_timeouts"):
        assert key in last, key
    assert last["turns_mean"] >= 2.0 and last["turns_max"] <= 3       # every episode got a message reply
    assert last["env_errors"] == last["env_timeouts"] == 0 and last["finish_done"] + last["finish_turns"] > 0
    print(f"\nchat tool episodes, 20 steps: turns {last['turns_mean']:.2f} (max {last['turns_max']:.0f}), "
          f"tool calls {last['tool_calls']:.0f} ({last['tool_errors']:.0f} failed), "
          f"ends done {last['finish_done']:.0f} / turns {last['finish_turns']:.0f} / length {last['finish_length']:.0f}")


def test_an_agent_function_runs_through_the_whole_pipeline(ray_with_tests: None, tiny_model_dir: str,
                                                           tmp_path: Path) -> None:
    """``calc`` as agent code (``--task.agent``): the openai client against the worker's endpoint
    inside a Ray run; the agent's own numbers reach ``metrics.jsonl`` as ``agent/NAME``."""
    cfg = tiny_run_config(tiny_model_dir, tmp_path / "run", "--max-steps", "4", "--task.name", "calc",
                          "--task.agent", "pipeline_rl.tasks.calc_agent:calc", "--rollout.max_model_len", "128",
                          "--rollout.max_new_tokens", "16")
    rows = _run(cfg)
    assert len(rows) == 4
    last = rows[-1]
    assert 1.0 <= last["agent/turns"] <= 4.0 and last["turns_mean"] >= 1.0   # the agent's "turns", the requests
    assert last["env_errors"] == last["env_timeouts"] == last["endpoint_refused"] == 0
