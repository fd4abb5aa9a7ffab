"""Smoke test of benchmarks/trainer.py (so it cannot rot): a few seconds, JSON written."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path


def test_trainer_benchmark_quick(tmp_path: Path) -> None:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "trainer.py"
    spec = importlib.util.spec_from_file_location("bench_trainer", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod        # dataclasses look their module up there
    spec.loader.exec_module(mod)
    out = tmp_path / "trainer.json"
    res = mod.main(["--quick", "--duration-s", "1", "--workers", "0", "--json", str(out)])
    figures = json.loads(out.read_text())
    for key in ("step_time_s", "publish_time_s", "trainer_idle_frac"):
        assert key in figures
    assert res.steps >= 1 and res.step_time_s > 0 and 0 <= res.trainer_idle_frac < 1
    assert res.publish_time_s > 0 and res.update_bytes > 0
