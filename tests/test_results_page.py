"""docs/results.md is built from the benchmarks' result files and kept up to date."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from benchmarks import results_page
from benchmarks.common import ROOT, portable
from benchmarks.results_page import CATALOG, Entry

#: The start of an absolute path of a machine (a home, a checkout, a temporary folder).
MACHINE_PATH = re.compile(r"(?<![\w./~$:-])/(?:root|home|Users|work|tmp|var|mnt|opt|scratch|data|srv)/")


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


def test_no_result_carries_a_path_of_the_machine() -> None:
    """A results page (and the page built from them) is read on other machines: paths in it
    are relative to the repository or the cache (``benchmarks.common.portable``)."""
    files = sorted(p for p in results_page.RESULTS.iterdir() if p.suffix in (".md", ".json", ".txt", ".csv"))
    found = [f"{f.relative_to(ROOT)}:{i}: {m.group(0)}..." for f in [*files, results_page.PAGE]
             for i, line in enumerate(f.read_text().splitlines(), 1) for m in MACHINE_PATH.finditer(line)]
    assert found == []


def test_the_reports_write_paths_relative_to_the_repository_or_the_cache() -> None:
    from pipeline_rl.models.default import cache_root

    text = (f"model ({cache_root() / 'smollm2-135m-instruct'}); python {ROOT / '.venv' / 'bin' / 'python'}; "
            f"run {ROOT}; out {Path(tempfile.gettempdir()).resolve() / 'soak' / 'run'}")
    assert portable(text) == ("model (.cache/pipeline_rl/smollm2-135m-instruct); python .venv/bin/python; "
                              "run .; out $TMPDIR/soak/run")
    assert not MACHINE_PATH.search(portable(text))


def test_the_lora_page_shows_native_servings_generation_beside_its_sync(tmp_path: Path) -> None:
    """Native serving's shorter weight sync is never shown without what it costs generation:
    its tokens/s over busy time and stall p50 sit beside it in the table, and the committed
    page's table is what ``benchmarks.lora_vs_full`` renders from the committed JSON."""
    import json

    from benchmarks import lora_vs_full

    saved = results_page.RESULTS / "lora_vs_full.json"
    assert lora_vs_full.main(["--from-json", str(saved), "--md", str(tmp_path / "page.md")]) == 0
    rendered = (tmp_path / "page.md").read_text().rstrip("\n")
    page = (results_page.RESULTS / "lora_vs_full.md").read_text()
    assert page.startswith(rendered), "lora_vs_full.md: table differs from --from-json's rendering of its JSON"
    full, native = (json.loads(saved.read_text())[k] for k in ("full", "native"))
    rate = native["tokens_per_s_busy_early"] / full["tokens_per_s_busy_early"]
    stall = native["stall_ms_p50"] / full["stall_ms_p50"]
    assert (f"| tokens/s over the worker's busy time, steps 4-10, native serving | "
            f"{full['tokens_per_s_busy_early']:.1f} | {native['tokens_per_s_busy_early']:.1f} | {rate:.2f} |") in page
    assert (f"| stall p50 (ms), native serving | {full['stall_ms_p50']:.1f} | "
            f"{native['stall_ms_p50']:.1f} | {stall:.2f} |") in page


def test_a_chaos_report_from_two_invocations_says_which_column_came_from_which() -> None:
    """The real-model chaos result was put together from two invocations: its table's first
    row names each column's; a result one invocation measured has no such row."""
    import json

    from benchmarks.chaos_report import markdown

    res = json.loads((results_page.RESULTS / "chaos_real_model.json").read_text())
    rendered, page = markdown(res), (results_page.RESULTS / "chaos_real_model.md").read_text()
    assert page.startswith(rendered) and "| measured by (invocation, start, commit) | benchmarks.chaos, " in page
    one = {"how": "benchmarks.chaos", "started_utc": "2026-12-04 16:48", "commit": "710ca69"}
    assert "measured by" not in markdown({**res, "sources": {"chaos": one, "unbroken": one}})
    assert "| launch/async_grpo.py alone" not in markdown({**res, "sources": {"chaos": one}})
    assert "| not recorded |" in markdown({**res, "sources": {"chaos": one}})
