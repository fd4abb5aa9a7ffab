"""Smoke test of ``python -m benchmarks.rollout`` (its ``--quick`` mode) so it cannot rot;
no timing is asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path


def test_rollout_benchmark_quick(tmp_path: Path) -> None:
    from benchmarks import rollout

    out = tmp_path / "rollout.json"
    assert rollout.main(["--quick", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for key in ("worker_tokens_per_s", "llm_generate_tokens_per_s", "stall_ms_p50", "memcpy_ms",
                "model_params"):
        assert isinstance(res[key], (int, float)) and math.isfinite(res[key]) and res[key] > 0, key
    assert res["updates_applied"] >= 1
