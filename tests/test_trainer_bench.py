"""Smoke test of ``python -m benchmarks.trainer`` (so it cannot rot): a few seconds, JSON written."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import trainer


def test_trainer_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "trainer.json"
    assert trainer.main(["--quick", "--duration-s", "1", "--workers", "0", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["steps"] >= 1 and res["step_time_s"] > 0 and 0 <= res["trainer_idle_frac"] < 1
    assert res["publish_time_s"] > 0 and res["update_bytes"] > 0
