"""Smoke test of ``benchmarks/weight_sync.py`` (a tiny model, the in-process engine,
both transports, 3 updates) so it cannot rot: the JSON schema and that every
published version reached generation; no timing is asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest


def test_weight_sync_benchmark_tiny(tmp_path: Path) -> None:
    from benchmarks import weight_sync as module

    out, md = tmp_path / "weight_sync.json", tmp_path / "weight_sync.md"
    argv = ["--models", "tiny", "--engines", "inprocess", "--updates", "3", "--warmup", "1", "--interval-s", "0.2",
            "--max-num-seqs", "8", "--max-new-tokens", "16", "--timeout-s", "60",
            "--json", str(out), "--md", str(md)]
    assert module.main(argv) == 0
    res = json.loads(out.read_text())
    assert {"hardware", "run_s", "settings", "models", "cells", "failed"} <= res.keys()
    assert res["failed"] == []
    assert res["models"]["tiny"]["params"] > 0
    cells = res["cells"]
    assert [(c["model"], c["engine"], c["transport"]) for c in cells] == [
        ("tiny", "inprocess", "vllm"), ("tiny", "inprocess", "object_store")]
    for c in cells:
        assert c["updates"] == 3 and len(c["latency_ms_all"]) == 3
        assert c["versions_complete"] is True
        assert c["versions_published"] == [1, 2, 3, 4]            # 1 warm-up + 3 timed
        assert max(c["versions_applied"]) == 4
        assert all(math.isfinite(x) and x > 0 for x in c["latency_ms_all"])
        for key in ("latency_ms", "stall_ms"):
            assert {"p50", "p90", "max", "mean"} <= c[key].keys()
            assert c[key]["p50"] is not None and c[key]["p50"] >= 0
        assert c["bytes_per_update"] == 4 * res["models"]["tiny"]["params"]
        assert c["publisher"]["offer_failures"] == 0
        assert c["tokens_per_s"] > 0
    assert cells[1]["latency_p50_vs_object_store"] == pytest.approx(1.0)
    assert cells[0]["publisher"]["send_ms"] is not None              # vllm: the send's phases
    assert "update_weights" in cells[1]["worker_calls_ms"]         # object_store: a path like the others
    text = md.read_text()
    assert text.startswith("Weight sync:") and "| tiny |" in text
