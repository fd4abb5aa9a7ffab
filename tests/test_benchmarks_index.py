"""docs/benchmarks.md names every module under benchmarks/, and its links resolve.

Invariants: every ``benchmarks/*.py`` but ``__init__.py`` has a link ``(../benchmarks/NAME.py)``
on the page; every relative link on the page (``benchmarks/results/...`` reports and figures,
the modules' sources, other docs) names a file that exists. File reads only: no imports of the
benchmarks, no processes.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
BENCHMARKS = ROOT / "benchmarks"

#: A Markdown link's target that is a relative path (not a URL, an absolute path or an anchor).
RELATIVE_LINK = re.compile(r"\]\((?!https?://|/|#)([^)#\s]+)(?:#[^)]*)?\)")


def modules() -> list[str]:
    """The benchmark package's modules, ``__init__`` left out."""
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.name != "__init__.py")


def unnamed_modules(text: str, names: list[str]) -> list[str]:
    """The modules of ``names`` that ``text`` has no ``(../benchmarks/NAME.py)`` link for."""
    return [name for name in names if f"](../benchmarks/{name}.py)" not in text]


def broken_links(text: str, base: Path) -> list[str]:
    """The relative link targets of ``text`` that name no file, resolved from ``base``."""
    return [link for link in RELATIVE_LINK.findall(text) if not (base / link).is_file()]


def test_every_benchmark_module_is_named() -> None:
    missing = unnamed_modules(PAGE.read_text(), modules())
    assert not missing, f"docs/benchmarks.md has no row for these benchmarks/ modules (add one each): {missing}"


def test_every_link_points_to_a_file() -> None:
    text = PAGE.read_text()
    assert "](../benchmarks/results/" in text, "docs/benchmarks.md links no result file"
    broken = broken_links(text, PAGE.parent)
    assert not broken, f"docs/benchmarks.md links to missing files: {broken}"


def test_the_checks_catch_a_missing_row_and_a_missing_file() -> None:
    text = "[a](../benchmarks/demo.py) [r](../benchmarks/results/nope.md) [u](https://a.b/c) [t](#top)"
    assert unnamed_modules(text, ["demo", "peers"]) == ["peers"]
    assert unnamed_modules("[p](../benchmarks/peers_trl.py)", ["peers"]) == ["peers"]
    assert broken_links(text, PAGE.parent) == ["../benchmarks/results/nope.md"]
