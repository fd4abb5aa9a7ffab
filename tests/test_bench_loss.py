"""Smoke test of benchmarks/loss.py (tiny shape) so the benchmark cannot rot."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from pipeline_rl.correction import CORRECTIONS


def test_loss_benchmark_quick(tmp_path: Path) -> None:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "loss.py"
    spec = importlib.util.spec_from_file_location("bench_loss", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_loss"] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "loss.json"
    assert mod.main(["--quick", "--reference", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["ms"]) == set(CORRECTIONS) | {f"ref:{n}" for n in CORRECTIONS}
    assert res["overhead"]["none"] == 0.0
    assert all(v > 0 for v in res["ms"].values())
