"""docs/layout.md's checkable claims, checked by reading the source (``ast``; nothing imported).

The tables below are the claims; docs/layout.md states the same in its "Checked claims"
section (a test reads that section and compares), so the doc and the code cannot drift:

- which modules import Ray at run time (:data:`RAY_ALLOWED`; an import under
  ``if TYPE_CHECKING:`` is a type, not a use, and does not count);
- which modules import vLLM at all (:data:`VLLM_ALLOWED`), and which may reach past its
  public surface (:data:`VLLM_PUBLIC`) into its internals (:data:`VLLM_INTERNALS_ALLOWED`):
  another vLLM module, or a private ``_name`` from any;
- no two modules share a file name;
- every file the doc's tree names exists, and the tree names every module (a package's
  ``__init__.py`` is named by its folder's line).

No import cycle is the other claim; ``tests/test_imports.py`` checks it (not repeated here).

An import is an ``import``/``from`` statement anywhere in a module (inside functions too),
or a string naming a module where it is imported by name: an argument of
``importlib.import_module``/``__import__``/``find_spec``, or an element of a literal list,
tuple or set of module names, two or more of them dotted (a preload list). A logger name is not one.
An entry ``a.b`` of a table covers the module ``a.b`` and, when it is a package, everything
under it.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pipeline_rl"
LAYOUT = ROOT / "docs" / "layout.md"

#: Modules (or packages) that may import Ray at run time.
RAY_ALLOWED = frozenset({
    "pipeline_rl.actors",
    "pipeline_rl.run",
    "pipeline_rl.weight_sync.publish.publisher",   # its Ray-actor client (calls a worker's actor)
    "pipeline_rl.weight_sync.channels.object_store",  # the object-store path: ray.put / ray.get of a version
    "pipeline_rl.weight_sync.publish.clients",     # a worker's Ray actor as vLLM's weight-sync client; the node IP
    "pipeline_rl.weight_sync.channels.paths",       # this process's Ray node id (which path a worker gets)
})
#: Modules (or packages) that may import vLLM.
VLLM_ALLOWED = frozenset({"pipeline_rl.rollout", "pipeline_rl.weight_sync",
                          "pipeline_rl.tasks.tool_calls"})   # inside its parser only: the tasks import no vLLM
#: vLLM's public surface: the modules any of :data:`VLLM_ALLOWED` may import (no private names).
VLLM_PUBLIC = frozenset({
    "vllm", "vllm.sampling_params", "vllm.outputs", "vllm.config",
    "vllm.v1.engine.llm_engine", "vllm.v1.engine.async_llm",
    "vllm.distributed.weight_transfer.base",   # the weight-transfer engine API vLLM documents
})
#: The modules that may reach past :data:`VLLM_PUBLIC` (each with a fallback and a comment saying why).
VLLM_INTERNALS_ALLOWED = frozenset({
    "pipeline_rl.rollout.engines.vllm_compat",   # engines and weight transfer across vLLM 0.26-0.33
    "pipeline_rl.rollout.agents.vllm_tools",     # the OpenAI server's request/response types the endpoint speaks
    "pipeline_rl.tasks.tool_calls",              # the tool-call parsers `vllm serve --tool-call-parser` uses
    "pipeline_rl.weight_sync.receive.vllm_adapter",   # the weights' side: backend registry, reloads, NCCL, packing
})
#: Packages that import nothing from another: (lower, upper) -- weights know no engine.
NO_UPWARD_IMPORTS = (("pipeline_rl.weight_sync", "pipeline_rl.rollout"),)


_IMPORTERS = {"import_module", "__import__", "find_spec"}
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


@dataclass(frozen=True)
class Use:
    """One import in a module: the module imported, the names taken from it, the line,
    and whether it only serves type checking (under ``if TYPE_CHECKING:``)."""

    module: str
    names: tuple[str, ...]
    line: int
    type_only: bool


def modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``package``."""
    out = {}
    for f in sorted(package.rglob("*.py")):
        parts = f.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _string_uses(node: ast.AST, type_only: bool) -> Iterator[Use]:
    """Module names given as strings where they are imported by name (see the module doc)."""
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in _IMPORTERS and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            yield Use(node.args[0].value, (), node.lineno, type_only)
    elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        texts = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        if len(texts) == len(node.elts) and all(_MODULE.match(t) for t in texts) \
                and sum("." in t for t in texts) >= 2:
            yield from (Use(t, (), node.lineno, type_only) for t in texts)


def uses(tree: ast.AST, type_only: bool = False) -> Iterator[Use]:
    """Every import under ``tree`` (absolute modules; relative imports are the package's own)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from (u for child in node.body for u in uses_of(child, True))
            yield from (u for child in node.orelse for u in uses_of(child, type_only))
            continue
        yield from uses_of(node, type_only)


def uses_of(node: ast.AST, type_only: bool) -> Iterator[Use]:
    if isinstance(node, ast.Import):
        yield from (Use(a.name, (), node.lineno, type_only) for a in node.names)
    elif isinstance(node, ast.ImportFrom):
        if not node.level and node.module:
            yield Use(node.module, tuple(a.name for a in node.names), node.lineno, type_only)
    else:
        yield from _string_uses(node, type_only)
        yield from uses(node, type_only)


def _covered(module: str, table: Iterable[str]) -> bool:
    return any(module == entry or module.startswith(entry + ".") for entry in table)


def _of(module: str, top: str) -> bool:
    return module == top or module.startswith(top + ".")


@functools.lru_cache(maxsize=None)
def _uses_in(path: Path, mtime_ns: int) -> tuple[Use, ...]:
    return tuple(uses(ast.parse(path.read_text(), str(path))))


def _checked(package: Path, skip: Iterable[str]) -> Iterator[tuple[str, Path, tuple[Use, ...]]]:
    """Each module not in ``skip`` with its imports (each file parsed once per session)."""
    for name, path in modules(package).items():
        if not _covered(name, skip):
            yield name, path, _uses_in(path, path.stat().st_mtime_ns)


def ray_violations(package: Path, allowed: Iterable[str] = RAY_ALLOWED, skip: Iterable[str] = ()) -> list[str]:
    """``module:line imports ray`` for each run-time Ray import outside ``allowed``."""
    return [f"{name}:{u.line} imports {u.module}" for name, _, found in _checked(package, skip)
            if not _covered(name, allowed) for u in found if _of(u.module, "ray") and not u.type_only]


def vllm_violations(package: Path, allowed: Iterable[str] = VLLM_ALLOWED,
                    public: Iterable[str] = VLLM_PUBLIC,
                    internals_allowed: Iterable[str] = VLLM_INTERNALS_ALLOWED,
                    skip: Iterable[str] = ()) -> list[str]:
    """vLLM imported outside ``allowed``, or its internals outside ``internals_allowed``."""
    public = frozenset(public)
    out = []
    for name, _, found in _checked(package, skip):
        for u in (u for u in found if _of(u.module, "vllm")):
            private = [n for n in u.names if n.startswith("_")]
            if not _covered(name, allowed):
                out.append(f"{name}:{u.line} imports {u.module} (vLLM outside {sorted(allowed)})")
            elif (u.module not in public or private) and not _covered(name, internals_allowed):
                what = f"{u.module}.{private[0]}" if private else u.module
                out.append(f"{name}:{u.line} reaches vLLM's internals ({what})")
    return out


def duplicate_names(package: Path) -> dict[str, list[str]]:
    """File name (without ``.py``) -> the modules that share it, for names used twice or more
    (``__init__`` aside)."""
    seen: dict[str, list[str]] = defaultdict(list)
    for name, path in modules(package).items():
        if path.name != "__init__.py":
            seen[path.stem].append(name)
    return {stem: names for stem, names in seen.items() if len(names) > 1}


def tree_files(layout: str) -> list[tuple[str, list[str]]]:
    """``(file name, the folders it may be in)`` for every ``*.py`` the doc's tree block names.

    The tree: a line starting with ``folder/`` (or ``a/, b/``) opens those folders inside the
    folders open at a smaller indent (two spaces: the package's top); one indented two spaces
    naming files is at the package's top; other lines belong to the folders last opened."""
    block = layout.split("```", 2)[1] if layout.count("```") >= 2 else ""
    stack: list[tuple[int, list[str]]] = [(0, [""])]
    out = []
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        head = re.match(r"\s*((?:[\w]+/,?\s*)+)", line) if indent >= 2 else None
        if head or indent == 2:
            while len(stack) > 1 and stack[-1][0] >= indent:
                stack.pop()
        if head:
            parents = stack[-1][1]
            names = [f.strip().rstrip("/") for f in head.group(1).split(",") if f.strip()]
            stack.append((indent, [f"{p}/{n}".lstrip("/") for p in parents for n in names]))
        folders = stack[-1][1]
        out += [(f, list(folders)) for f in re.findall(r"(?<![\w/])\w+\.py\b", line)]   # not a/b.py
    return out


def missing_tree_files(layout: str, package: Path) -> list[str]:
    return [f"{'|'.join(dirs) or '.'}/{name}" for name, dirs in tree_files(layout)
            if not any((package / d / name).is_file() for d in dirs)]


def claimed(layout: str, claim: str) -> set[str]:
    """The backquoted paths of the doc's "Checked claims" line starting with ``claim``, as
    dotted module names (``run/`` -> ``pipeline_rl.run``)."""
    section = layout.partition("## Checked claims")[2]
    items = re.split(r"^- ", section, flags=re.M)[1:]   # a bullet goes on over its indented lines
    lines = [item for item in items if item.startswith(claim)]
    assert len(lines) == 1, f"docs/layout.md: no single claims line starting with {claim!r}"
    paths = re.findall(r"`([\w.]*/[\w/.]*)`", lines[0])   # paths only (a folder/ or folder/file.py)
    return {"pipeline_rl." + p.rstrip("/").removesuffix(".py").replace("/", ".") for p in paths}


# -- the claims, on this tree ---------------------------------------------------------------

def test_only_the_listed_modules_import_ray() -> None:
    assert ray_violations(PACKAGE) == []


def test_only_the_listed_modules_import_vllm_or_its_internals() -> None:
    assert vllm_violations(PACKAGE) == []


def upward_violations(package: Path, rules: Iterable[tuple[str, str]] = NO_UPWARD_IMPORTS) -> list[str]:
    """``module:line imports X`` for each import from ``upper`` in a module of ``lower``."""
    return [f"{name}:{u.line} imports {u.module}" for lower, upper in rules
            for name, _, found in _checked(package, ()) if _covered(name, {lower})
            for u in found if _of(u.module, upper)]


def test_weight_sync_imports_nothing_from_rollout() -> None:
    assert upward_violations(PACKAGE) == []
    tail = LAYOUT.read_text().partition("## Checked claims")[2]
    assert "`weight_sync/` imports nothing from `rollout/`" in tail


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {"__init__.py": "", "ws/__init__.py": "", "ws/a.py": "def f():\n    from pkg.ro import x\n",
                              "ro/__init__.py": "", "ro/x.py": "import pkg.ws.a\n"})
    assert upward_violations(pkg, (("pkg.ws", "pkg.ro"),)) == ["pkg.ws.a:2 imports pkg.ro"]


MAX_MODULE_LINES = 450


def test_no_module_is_longer_than_the_bound() -> None:
    """A module past the bound is a room holding two things: split it by what it does."""
    long = {f.relative_to(PACKAGE).as_posix(): n for f in sorted(PACKAGE.rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"
    tail = LAYOUT.read_text().partition("## Checked claims")[2]
    assert f"No module of the package is longer than {MAX_MODULE_LINES} lines." in tail


def test_no_two_modules_share_a_name() -> None:
    assert duplicate_names(PACKAGE) == {}


def unnamed_modules(layout: str, package: Path) -> list[str]:
    """The modules under ``package`` (``__init__.py`` aside) that the doc's tree does not name."""
    named = {f"{d}/{name}".lstrip("/") for name, dirs in tree_files(layout) for d in dirs}
    return [rel for f in sorted(package.rglob("*.py"))
            if f.name != "__init__.py" and (rel := f.relative_to(package).as_posix()) not in named]


def test_every_file_the_tree_names_exists() -> None:
    assert missing_tree_files(LAYOUT.read_text(), PACKAGE) == []


def test_the_tree_names_every_module() -> None:
    assert unnamed_modules(LAYOUT.read_text(), PACKAGE) == []


def test_the_doc_states_the_tables() -> None:
    """docs/layout.md's "Checked claims" lines name exactly the modules of the tables."""
    doc = LAYOUT.read_text()
    assert claimed(doc, "Ray is imported") == RAY_ALLOWED
    assert claimed(doc, "vLLM is imported") == VLLM_ALLOWED
    assert claimed(doc, "vLLM's internals") == VLLM_INTERNALS_ALLOWED
    assert "No two modules share a name" in doc.partition("## Checked claims")[2]


# -- the checker catches a broken claim ------------------------------------------------------

def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "pkg"
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_a_broken_claim_fails(tmp_path: Path) -> None:
    """A synthetic package breaking every claim: each check names the offender and line."""
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "run/__init__.py": "",
        "run/driver.py": "import ray\n",                                    # allowed
        "buffer/__init__.py": "",
        "buffer/replay.py": "def f():\n    import ray\n",                    # Ray where none may be
        "buffer/types.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ray import ObjectRef\n",
        "rollout/__init__.py": "",
        "rollout/compat.py": "from vllm.model_executor.models import registry\n",   # allowed internals
        "rollout/engine.py": "from vllm import SamplingParams\nfrom vllm.config import _private\n",
        "rollout/pre.py": "import importlib\nMODS = ('vllm', 'vllm.v1.worker.cpu_worker', 'vllm.config')\n"
                          "importlib.import_module('ray.util')\n",
        "training/__init__.py": "",
        "training/logs.py": "import logging\nlogging.getLogger('vllm.model_executor.x')\n",   # not an import
        "training/replay.py": "",                                                 # name used twice
    })
    allowed = {"pkg.run"}
    assert ray_violations(pkg, allowed, skip=()) == ["pkg.buffer.replay:2 imports ray",
                                                     "pkg.rollout.pre:3 imports ray.util"]
    assert vllm_violations(pkg, allowed={"pkg.rollout"}, internals_allowed={"pkg.rollout.compat"}, skip=()) == [
        "pkg.rollout.engine:2 reaches vLLM's internals (vllm.config._private)",
        "pkg.rollout.pre:2 reaches vLLM's internals (vllm.v1.worker.cpu_worker)"]
    assert vllm_violations(pkg, allowed={"pkg.training"}, skip=())[0].startswith(
        "pkg.rollout.compat:1 imports vllm.model_executor.models (vLLM outside")
    assert duplicate_names(pkg) == {"replay": ["pkg.buffer.replay", "pkg.training.replay"]}
    assert ray_violations(pkg, allowed, skip={"pkg.buffer", "pkg.rollout.pre"}) == []


def test_the_tree_reader_finds_a_missing_file(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {"__init__.py": "", "config.py": "", "run/__init__.py": "", "run/a.py": "",
                              "tasks/env.py": ""})
    doc = ("```\npkg/\n  config.py, gone.py    top\n\n  run/    conductor\n    a.py    here\n"
           "    b.py, c.py   not here\n    deep/   nested\n      a.py   not there\n"
           "  tasks/, models/   both (env.py)\n                (x.py)\n```\n")
    assert missing_tree_files(doc, pkg) == ["./gone.py", "run/b.py", "run/c.py", "run/deep/a.py", "tasks|models/x.py"]
    (pkg / "run" / "unnamed.py").write_text("")
    assert unnamed_modules(doc, pkg) == ["run/unnamed.py"]   # config.py, run/a.py, tasks/env.py are named


def test_the_claims_reader_reads_the_doc_lines() -> None:
    doc = ("## Checked claims\n- Ray is imported at run time only in `actors/` (not `vllm`) and\n"
           "  `weight_sync/message.py`.\n- Other.\n")
    assert claimed(doc, "Ray is imported") == {"pipeline_rl.actors", "pipeline_rl.weight_sync.message"}
    with pytest.raises(AssertionError, match="no single claims line"):
        claimed(doc, "vLLM is imported")
