"""Smoke test of ``python -m benchmarks.loss`` (tiny shape) so the benchmark cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import loss
from pipeline_rl.correction import CORRECTIONS


def test_loss_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "loss.json"
    assert loss.main(["--quick", "--reference", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["ms"]) == set(CORRECTIONS) | {f"ref:{n}" for n in CORRECTIONS}
    assert res["overhead"]["none"] == 0.0
    assert all(v > 0 for v in res["ms"].values())
