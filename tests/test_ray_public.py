"""The project stands on Ray's public API (issue 43): an audit of the source, at the level
of its syntax.

- Nothing assigns to an attribute of a Ray module or class (``ray.x.y = ...``,
  ``setattr(ray_module, ...)``, ``del ray.x``): no patched internals.
- No module imports a private Ray module (``ray._private``, ``ray._raylet``, any
  ``ray._*``) or reaches one through an attribute (``ray._private.worker``): no reads of
  Ray's internals either.
- No stand-in for Ray's worker start (``setup_worker.py``, ``default_worker.py``) or its
  agents, and none of the environment-variable side channels they needed, in the code
  (the docs may tell their history).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: What the audit reads: the package, the benchmarks and the launcher.
AUDITED = ("pipeline_rl", "benchmarks", "launch")
#: Words only a stand-in for Ray's worker start or agents, or their side channels, would use.
STAND_IN_WORDS = ("setup_worker", "default_worker", "SETUP_WORKER_FILENAME", "dashboard_agent",
                  "runtime_env_agent", "_build_python_executable_command", "PIPELINE_RL_PRELOAD",
                  "PIPELINE_RL_PLAN_CPUS", "wait_for_persisted_port", "all_processes")


def _root_name(node: ast.AST) -> str | None:
    """``a`` of ``a.b.c``, ``a.b[0].c`` or ``a``; None for anything else."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _dotted(node: ast.AST) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _private(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "ray" and any(p.startswith("_") for p in parts[1:])


def _ray_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> what of Ray's it is bound to, for every import of Ray in ``tree``."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "ray":
                    names[a.asname or "ray"] = a.name if a.asname else "ray"
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "ray":
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def audit(source: str) -> list[str]:
    """What in ``source`` breaks the rules of the module docstring, one line each."""
    tree = ast.parse(source)
    ray_names = _ray_names(tree)
    found: list[str] = []

    def is_ray(node: ast.AST) -> bool:
        root = _root_name(node)
        return root is not None and root in ray_names

    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and is_ray(sub):
                    found.append(f"line {line}: assigns to {_dotted(sub) or 'an attribute'} of Ray's")
        if isinstance(node, ast.Call) and node.args:
            func = _dotted(node.func) or ""
            first = node.args[0]
            imported = (isinstance(first, ast.Call) and (_dotted(first.func) or "").endswith("import_module")
                        and first.args and isinstance(first.args[0], ast.Constant)
                        and str(first.args[0].value).split(".")[0] == "ray")
            if func.split(".")[-1] in ("setattr", "delattr", "__setattr__") and (is_ray(first) or imported):
                found.append(f"line {node.lineno}: {func}() on Ray's {_dotted(first) or 'module'}")
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: imports {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found += [f"line {node.lineno}: imports {node.module}.{a.name}" for a in node.names
                      if _private(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Attribute) and is_ray(node):
            dotted = _dotted(node)
            root = _root_name(node)
            if dotted and root and _private(ray_names[root] + dotted[len(root):]):
                found.append(f"line {node.lineno}: reaches {dotted}")
    return sorted(set(found))


def _sources() -> list[Path]:
    return sorted(p for d in AUDITED for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_patched_ray_and_no_private_import(path: Path) -> None:
    rel = str(path.relative_to(ROOT))
    problems = audit(path.read_text())
    assert not problems, f"{rel}: " + "; ".join(problems)


def test_no_stand_in_for_rays_workers_or_agents_in_the_tree() -> None:
    this = Path(__file__).resolve()
    files = [p for d in (*AUDITED, "tests", "scripts") if (ROOT / d).exists()
             for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in (".py", ".sh", ".toml")
             and p.resolve() != this]
    hits = [f"{p.relative_to(ROOT)}: {w}" for p in files for w in STAND_IN_WORDS if w in p.read_text(errors="replace")]
    assert not hits, "; ".join(hits)
    gone = ("ray_worker.py", "ray_agents.py", "preload.py", "ray_compat.py")
    assert not [p for p in (ROOT / "pipeline_rl").rglob("*.py") if p.name in gone]


@pytest.mark.parametrize("source, why", [
    ("import ray._private.services as s\ns.get_node = None\n", "assigns"),
    ("import ray\nray._private.worker._global_node = 1\n", "assigns"),
    ("from ray._private.node import Node\nsetattr(Node, 'start_monitor', None)\n", "setattr"),
    ("import importlib\nsetattr(importlib.import_module('ray._private.utils'), 'x', 1)\n", "setattr"),
    ("from ray._private import ray_constants as c\nc.SETUP_WORKER_FILENAME = 'x'\n", "assigns"),
    ("import ray\ndel ray.util.x\n", "assigns"),
    ("from ray import _raylet\n", "imports ray._raylet"),
    ("import ray\nn = ray._private.worker._global_node\n", "reaches ray._private"),
])
def test_the_audit_catches_what_it_forbids(source: str, why: str) -> None:
    assert any(why in line for line in audit(source)), audit(source)


def test_the_audit_lets_public_use_through() -> None:
    public = ("import ray\nfrom ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy\n"
              "ray.init(address='local', num_cpus=2)\nx = ray.get_runtime_context().get_node_id()\n"
              "class A:\n    pass\nA.remote = 1\n")
    assert audit(public) == []
