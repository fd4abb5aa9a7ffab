"""The benchmarks are one harness (``benchmarks/common.py``): each runs as
``python -m benchmarks.NAME`` from the repository root, takes ``--json PATH`` and
``--md PATH``, and its ``--help`` documents every flag (the harness refuses a flag without
help); one of them runs here as a user runs it."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Entry points of the benchmarks package that measure nothing (no --json / --md of their own).
TOOLS = {"results_page"}   # builds docs/results.md from the benchmarks' reports
ENTRY_POINTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py")
                      if 'if __name__ == "__main__":' in p.read_text() and p.stem not in TOOLS)


def test_every_benchmark_has_an_entry_point() -> None:
    assert {"ablation", "codec", "soak", "throughput", "weight_sync"} <= set(ENTRY_POINTS)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_documents_every_flag(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m benchmarks.{name}")
    assert "--json PATH" in text and "--md PATH" in text


def test_a_benchmark_runs_as_a_user_runs_it(tmp_path: Path) -> None:
    out, md = tmp_path / "codec.json", tmp_path / "codec.md"
    done = subprocess.run([sys.executable, "-m", "benchmarks.codec", "--seconds", "0.2", "--json", str(out),
                           "--md", str(md)], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.read_text())["groups_per_s"] > 0
    assert done.stdout.startswith("codec: ") and md.read_text() == done.stdout
