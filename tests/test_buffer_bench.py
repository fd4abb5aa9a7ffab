"""Smoke run of ``python -m benchmarks.buffer --quick --keys``, as a user runs it: it runs end
to end, plain and with the run key, loses nothing and writes the documented JSON keys; and
``benchmarks.codec --keys``. No timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_buffer_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "buffer.json"
    subprocess.run([sys.executable, "-m", "benchmarks.buffer", "--quick", "--keys", "--json", str(out)],
                   check=True, cwd=ROOT, timeout=120, capture_output=True)
    report = json.loads(out.read_text())
    for key in ("groups_per_s_1", "groups_per_s_4", "bare_zmq_groups_per_s", "lost", "ratio_to_bare",
                "ratio_to_bare_min", "ratio_to_bare_max", "repeats", "keyed_groups_per_s_4", "keys_ratio_4"):
        assert key in report
    assert report["lost"] == 0 and report["groups_per_s_4"] > 0 and report["bare_zmq_groups_per_s"] > 0
    assert [r["groups"] for r in report["runs"]] == [400] * 6   # plain 1 and 4, bare 1 and 4, keyed 1 and 4
    assert report["keys_ratio_4"] > 0


def test_codec_benchmark_with_keys(tmp_path: Path) -> None:
    out = tmp_path / "codec.json"
    subprocess.run([sys.executable, "-m", "benchmarks.codec", "--seconds", "0.2", "--keys", "--json", str(out)],
                   check=True, cwd=ROOT, timeout=120, capture_output=True)
    report = json.loads(out.read_text())
    assert report["link_groups_per_s"] > 0 and report["link_keyed_groups_per_s"] > 0 and report["keys_ratio"] > 0
    assert report["link_curve_groups_per_s"] > 0 and report["keys_ratio_curve"] > 0
