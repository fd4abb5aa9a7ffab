"""docs/results.md is built from the benchmarks' result files and kept up to date."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import results_page
from benchmarks.results_page import CATALOG, Entry


def test_page_is_up_to_date() -> None:
    assert results_page.main(["--check"]) == 0, "run: python -m benchmarks.results_page"


def test_every_result_report_is_on_the_page() -> None:
    on_page = {e.stem for e in CATALOG}
    reports = {p.stem for p in results_page.RESULTS.glob("*.md")}
    assert reports <= on_page, f"result files missing from the results-page catalog (CATALOG): {sorted(reports - on_page)}"


def test_a_report_without_its_machine_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bare.md").write_text("| a | b |\n|---|---|\n| 1 | 2 |\n")
    monkeypatch.setattr(results_page, "RESULTS", tmp_path)
    monkeypatch.setattr(results_page, "CATALOG", (Entry("bare", "Bare", "python -m benchmarks.bare", "x"),))
    with pytest.raises(ValueError, match="names no machine"):
        results_page.render()
    monkeypatch.setattr(results_page, "CATALOG", (Entry("gone", "Gone", "python -m benchmarks.gone", "x"),))
    with pytest.raises(ValueError, match="gone.md is missing"):
        results_page.render()
