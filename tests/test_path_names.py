"""Weight paths are decided by their row, never by their name: no module of the package
but ``weight_sync/channels/path_table.py`` compares a string naming a weight path (``==``/``!=``/
``is``, ``in`` a literal tuple, list or set or a name ``in`` something, a ``case``),
checked by reading the source (``ast``). A process-group backend (``backend ==
"nccl"``: an operand named ``backend``) is torch's name, not a weight path's.

The table's names are those of its ``Literal`` and of ``channel.PATHS`` (the paths' code).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

from pipeline_rl.weight_sync.channels.channel import PATHS
from pipeline_rl.weight_sync.channels.path_table import PATH_TABLE, PathName

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pipeline_rl"
TABLE = PACKAGE / "weight_sync" / "channels" / "path_table.py"
NAMES = frozenset(get_args(PathName))


def _names_a_path(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value in NAMES


def _is_backend(node: ast.expr) -> bool:
    return ((isinstance(node, ast.Name) and node.id == "backend")
            or (isinstance(node, ast.Attribute) and node.attr == "backend"))


def _compares_a_name(node: ast.Compare) -> bool:
    left = node.left
    for op, right in zip(node.ops, node.comparators):
        if isinstance(op, (ast.In, ast.NotIn)):
            literal = isinstance(right, (ast.Tuple, ast.List, ast.Set)) and any(map(_names_a_path, right.elts))
            if _names_a_path(left) or literal:
                return True
        elif (_names_a_path(left) and not _is_backend(right)) or (_names_a_path(right) and not _is_backend(left)):
            return True
        left = right
    return False


def name_comparisons(source: str, where: str) -> list[str]:
    """``where:line: code`` for each comparison of a weight path's name in ``source``."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and _compares_a_name(node):
            hits.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.match_case) and any(
                isinstance(p, ast.MatchValue) and _names_a_path(p.value) for p in ast.walk(node.pattern)):
            hits.append(f"{where}:{node.pattern.lineno}: case {ast.unparse(node.pattern)}")
    return hits


def test_no_module_decides_by_a_path_name() -> None:
    hits = [hit for f in sorted(PACKAGE.rglob("*.py")) if f != TABLE
            for hit in name_comparisons(f.read_text(), str(f.relative_to(ROOT)))]
    assert not hits, "a weight path decided by its name (read its row of path_table.PATH_TABLE):\n" + "\n".join(hits)


def test_a_comparison_by_name_is_caught() -> None:
    caught = ("p == 'shm'", "'nccl' != p", "p in ('ipc', 'x')", "'ipc' in gpu_paths", "p in {'gloo'}",
              "match p:\n case 'object_store': pass")
    for code in caught:
        assert len(name_comparisons(code, "x")) == 1, code
    for code in ("backend == 'nccl'", "self.backend != 'gloo'", "p == 'auto'", "row.auto == 'gpu'", "x = 'shm'"):
        assert not name_comparisons(code, "x"), code


def test_one_name_set_for_both_tables() -> None:
    assert set(PATH_TABLE) == NAMES == set(PATHS)
