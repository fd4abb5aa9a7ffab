"""Smoke test of ``benchmarks/rollout.py`` (its ``--quick`` mode) so it cannot rot;
no timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "rollout.py"


def test_rollout_benchmark_quick(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_rollout", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    out = tmp_path / "rollout.json"
    assert module.main(["--quick", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for key in ("worker_tokens_per_s", "llm_generate_tokens_per_s", "stall_ms_p50", "memcpy_ms",
                "model_params"):
        assert isinstance(res[key], (int, float)) and math.isfinite(res[key]) and res[key] > 0, key
    assert res["updates_applied"] >= 1
