"""scripts/wheelhouse.py and `scripts/setup.sh --wheelhouse`: an offline install.

The end-to-end test builds a wheelhouse for this machine whose --have lists everything the
project's environment has except DeepSpeed (published only as source: the wheelhouse builds
it), two of its small pure-Python dependencies (hjson, py-cpuinfo) and the project itself.
It then installs it with setup.sh into a fresh environment that sees the rest of the
project's environment, with no package index reachable, and checks that those four import
from the fresh environment. Building the wheelhouse downloads the two small wheels and
DeepSpeed's 2 MB source from PyPI (pip's cache serves later runs).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import distribution, distributions
from pathlib import Path
from types import ModuleType

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "wheelhouse.py"
LEFT_OUT = ["deepspeed", "hjson", "py-cpuinfo", "pipeline_rl"]  # what the fresh environment lacks


def load_wheelhouse() -> ModuleType:
    spec = importlib.util.spec_from_file_location("wheelhouse", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["wheelhouse"] = module
    spec.loader.exec_module(module)
    return module


wh = load_wheelhouse()


def run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


# --- pieces, no network -------------------------------------------------------------------

def test_have_file_and_platforms(tmp_path: Path) -> None:
    have = tmp_path / "have.txt"
    have.write_text("# comment\nTorch==2.11.0+cu130\nPy_CPUInfo\n-e git+https://x/y#egg=z\nray @ file:///r.whl\n\n")
    assert wh.read_have(have) == {"torch": "2.11.0+cu130", "py-cpuinfo": None, "ray": None}
    tags = wh.older_platforms("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert wh.Target("3.12", ["manylinux_2_28_aarch64"], "gpu").markers()["platform_machine"] == "aarch64"


class FakeResolver(wh.Resolver):  # type: ignore[misc, name-defined]
    """Resolves against an in-memory index: name -> version -> Requires-Dist."""

    INDEX: dict[str, dict[str, list[str]]] = {
        "vllm": {"0.26.0": ["torch==2.11.0", "apache-tvm-ffi==0.1.10", "xgrammar<1,>=0.2.1", "numpy<2.3",
                            "cutlass==4.6.0", "frontend>=1.19"]},
        "xgrammar": {"0.2.6": ["apache-tvm-ffi>=0.1.10"], "0.2.7": ["apache-tvm-ffi>=0.1.10", "numpy"],
                     "0.2.8": ["apache-tvm-ffi>=0.1.11", "torch>=1.10", "numpy"]},
        "apache-tvm-ffi": {"0.1.10": [], "0.1.11": [], "0.1.12": []},
        "numpy": {"2.2.6": [], "2.3.1": []},
        "cutlass": {"4.6.0": [], "4.8.1": []},
        "frontend": {"1.19.0": ["cutlass>=4.8"], "1.20.0": ["cutlass>=4.8"]},
    }

    def fetch(self, name: str, spec: SpecifierSet) -> object:
        versions = [v for v in self.INDEX.get(name, {}) if spec.contains(v, prereleases=True)]
        if not versions:
            raise wh.NoWheel(f"no wheel of {name}{spec}")
        version = str(max(map(Version, versions)))
        wheel = self.out / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        meta = "".join(f"Requires-Dist: {r}\n" for r in self.INDEX[name][version])
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", f"Name: {name}\n{meta}")
        return wh.Pick(Version(version), wheel, spec)

    def versions(self, name: str) -> list[Version]:
        return sorted(map(Version, self.INDEX[name]), reverse=True)


def test_resolver_backtracks_then_takes_the_newer_and_keeps_torch(tmp_path: Path) -> None:
    target = wh.Target("3.12", ["manylinux_2_28_x86_64"], "gpu")
    res = FakeResolver(target, {"torch": "2.11.0+cu130"}, tmp_path)
    res.resolve([wh.Requirement("vllm==0.26.0"), wh.Requirement("numpy>=1.26")])
    picked = {name: str(p.version) for name, p in res.picks.items()}
    # vLLM pins apache-tvm-ffi 0.1.10, xgrammar 0.2.8 wants >= 0.1.11: xgrammar 0.2.7 (as pip
    # would); no release of frontend takes vLLM's cutlass: the newer cutlass; numpy meets both.
    assert picked == {"vllm": "0.26.0", "numpy": "2.2.6", "apache-tvm-ffi": "0.1.10", "xgrammar": "0.2.7",
                      "cutlass": "4.8.1", "frontend": "1.20.0"}
    assert [" ".join(n.split(" ")[:3]) for n in res.notes] == ["older: xgrammar 0.2.7", "conflict: cutlass ==4.6.0"]
    assert res.skipped == {"torch": "2.11.0+cu130"}
    (tmp_path / "x").mkdir()
    with pytest.raises(wh.WheelhouseError, match="torch 2.13.0, which is never replaced"):
        FakeResolver(target, {"torch": "2.13.0"}, tmp_path / "x").resolve([wh.Requirement("vllm==0.26.0")])


def test_one_line_errors(tmp_path: Path) -> None:
    out = run([sys.executable, str(SCRIPT), str(tmp_path / "w"), "--flavour", "gpu", "--vllm", "0.20.0"])
    assert out.returncode == 1 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "vllm 0.20.0 is outside pyproject.toml's vllm<0.34,>=0.26" in out.stderr
    have = tmp_path / "have.txt"
    have.write_text("torch==2.12.0\n")
    out = run([sys.executable, str(SCRIPT), str(tmp_path / "w"), "--flavour", "gpu", "--have", str(have)])
    assert out.returncode == 1 and "target's torch 2.12.0; supported: torch 2.11.0 (vLLM 0.26.0)" in out.stderr
    out = run([sys.executable, str(SCRIPT), str(tmp_path / "w"), "--platform", "win_amd64"])
    assert out.returncode == 1 and "only Linux platforms" in out.stderr


# --- end to end: build here, install offline ----------------------------------------------

def machine_env(tmp_path: Path, gpu: bool, **extra: str) -> dict[str, str]:
    """This environment without pip settings, and a stand-in nvidia-smi that finds a GPU or not."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{'echo GPU 0: stand-in' if gpu else 'exit 1'}\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return env | {"PATH": f"{bin_dir}:{env['PATH']}", "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull} | extra


def site_view(dest: Path, leave_out: list[str]) -> Path:
    """A folder of links to every entry of this environment's site-packages except the
    distributions in leave_out (and the .pth files, which a view does not run)."""
    site = Path(sysconfig.get_paths()["purelib"])
    hidden = {Path(str(f)).parts[0] for name in leave_out for f in distribution(name).files or []}
    dest.mkdir()
    for entry in site.iterdir():
        if entry.name not in hidden and entry.suffix != ".pth":
            (dest / entry.name).symlink_to(entry)
    return dest


def test_offline_install_from_a_wheelhouse(tmp_path: Path) -> None:
    have = tmp_path / "have.txt"
    left = {n.replace("_", "-") for n in LEFT_OUT}
    names = {d.metadata["Name"] for d in distributions()}
    have.write_text("".join(f"{n}=={distribution(n).version}\n" for n in sorted(names)
                            if n.lower().replace("_", "-") not in left))
    house = tmp_path / "house"
    out = run([sys.executable, str(SCRIPT), str(house), "--have", str(have), "--flavour", "cpu"])
    assert out.returncode == 0, out.stderr
    manifest = (house / "MANIFEST.txt").read_text()
    wheels = sorted(line.split(" ")[1].split("-")[0] for line in manifest.splitlines() if line.startswith("wheel: "))
    assert wheels == ["deepspeed", "hjson", "pipeline_rl", "py_cpuinfo"], manifest
    assert "torch: the target's 2.13.0+cpu (not in this folder)" in manifest
    assert f"python: {sys.version_info[0]}.{sys.version_info[1]}" in manifest

    fresh = tmp_path / "fresh"
    base = getattr(sys, "_base_executable", sys.executable)
    assert run([base, "-m", "venv", str(fresh)]).returncode == 0
    fresh_site = fresh / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    (fresh_site / "project-view.pth").write_text(f"{site_view(tmp_path / 'view', LEFT_OUT)}\n")

    # No index: pip is told not to use one, and the one it would use does not answer.
    env = machine_env(tmp_path, gpu=False, PIP_INDEX_URL="http://127.0.0.1:9/simple", PYTHON=base,
                      PIPELINE_RL_VENV=str(fresh))
    setup = ["bash", str(ROOT / "scripts" / "setup.sh"), "--wheelhouse", str(house)]
    out = run(setup, env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "installing 4 wheels from" in out.stderr and "environment ready" in out.stderr

    probe = ("import json, deepspeed, hjson, cpuinfo, pipeline_rl, torch\n"
             "from importlib.metadata import entry_points\n"
             "print(json.dumps({'files': [m.__file__ for m in (deepspeed, hjson, cpuinfo, pipeline_rl)],\n"
             "  'torch': torch.__version__, 'plugins': [e.value for e in entry_points(group='vllm.general_plugins')]}))")
    got = json.loads(run([str(fresh / "bin" / "python"), "-c", probe], cwd=tmp_path).stdout)
    assert all(f.startswith(str(fresh_site)) for f in got["files"]), got["files"]
    assert got["torch"] == "2.13.0+cpu"
    assert "pipeline_rl.weight_sync.receive.vllm_adapter:register" in got["plugins"]

    # Re-running is the stamp's no-op; --dev wants test tools this wheelhouse lacks: one line.
    out = run(setup + ["--venv", str(fresh)], env, cwd=tmp_path)
    assert out.returncode == 0 and "environment up to date" in out.stderr, out.stderr
    out = run(setup + ["--dev"], env, cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "--extra dev" in out.stderr, out.stderr


def test_gpu_set_up_keeps_the_machines_torch_or_says_why(tmp_path: Path) -> None:
    """On an NVIDIA machine (a stand-in nvidia-smi here) whose Python is itself a virtual
    environment with a torch, set-up makes an environment that sees that torch. Where no vLLM
    is built for it (the project's CPU torch, 2.13.0+cpu) it stops with one line before
    installing; where one is (a GPU image's torch), it keeps the torch, asks for that vLLM
    and, with no package index here, fails installing it in one line."""
    torch = distribution("torch").version
    vllm = wh.VLLM_FOR_TORCH.get(Version(torch).public)
    venv = tmp_path / "gpu-env"
    env = machine_env(tmp_path, gpu=True, PYTHON=sys.executable)
    out = run(["bash", str(ROOT / "scripts" / "setup.sh"), "--venv", str(venv)], env, cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    if vllm is None:
        assert out.stderr.splitlines()[-1] == (
            f"setup.sh: FAILED: no vLLM release set-up knows is built for this machine's torch {torch}; "
            "supported: torch 2.11.0 (vLLM 0.26.0), torch 2.14.0 (vLLM 0.33.0)")
    else:
        assert f"keeping this machine's torch {torch}; vLLM {vllm} is built for it" in out.stderr, out.stderr
        assert out.stderr.splitlines()[-1].startswith("setup.sh: FAILED: installing the project"), out.stderr
    assert "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()
    probe = run([str(venv / "bin" / "python"), "-c", "import torch; print(torch.__file__)"], cwd=tmp_path)
    assert probe.stdout.startswith(sysconfig.get_paths()["purelib"]), probe
