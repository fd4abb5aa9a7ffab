"""The throughput benchmark runs end to end in a tiny configuration (real Ray, vLLM,
DeepSpeed, ZeroMQ) and writes the documented JSON schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import throughput

pytestmark = pytest.mark.slow


def test_throughput_quick_writes_schema(tiny_model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "tp"
    assert throughput.main(["--quick", "--model", tiny_model_dir, "--out", str(out),
                            "--json", str(tmp_path / "tp.json")]) == 0
    result = json.loads((tmp_path / "tp.json").read_text())
    assert {"hardware", "configs", "speedup_vs_same_placement_sync", "speedup_vs_best_sync",
            "overlap_bound"} <= result.keys()
    names = {c["name"] for c in result["configs"]}
    assert names == {"sync_same_placement", "async_s1", "async_s2", "async_s4", "sync_colocated"}
    for c in result["configs"]:
        assert {"name", "staleness", "step_time_s", "tokens_per_s", "trainer_idle_frac",
                "generator_idle_frac"} <= c.keys()
        assert c["step_time_s"] > 0
    assert result["overlap_bound"] >= 1.0
    assert (out / "throughput.md").read_text().startswith("Hardware:")
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"
