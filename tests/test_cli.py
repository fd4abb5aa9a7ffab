"""The ``pipeline-rl`` command (``pipeline_rl.cli.main``): ``run`` is ``launch/async_grpo.py``'s
main with the same arguments; ``--help`` lists the subcommands; a missing or unknown one is one
line, exit 2. Nothing starts Ray or vLLM: the driver's ``run`` is replaced."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from pipeline_rl import cli, driver
from pipeline_rl.config import Config

ROOT = Path(__file__).resolve().parent.parent


def _launcher() -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_grpo_under_test", ROOT / "launch" / "async_grpo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_launcher_and_run_share_one_main() -> None:
    assert _launcher().main is cli.train_main


def test_run_hands_its_arguments_to_the_main_job(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Config] = []

    def fake_run(cfg: Config) -> int:
        seen.append(cfg)
        return 7

    monkeypatch.setattr(driver, "run", fake_run)
    argv = ["--staleness", "5", "--max-steps", "3"]
    assert cli.main(["run", *argv]) == 7
    assert _launcher().main(argv) == 7
    assert len(seen) == 2 and seen[0] == seen[1]
    assert (seen[0].staleness, seen[0].max_steps) == (5, 3)


def test_run_passes_argv_through_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[list[str] | None] = []

    def fake_main(argv: list[str] | None = None) -> int:
        got.append(argv)
        return 0

    monkeypatch.setattr(cli, "train_main", fake_main)
    assert cli.main(["run", "--staleness", "2", "--", "x"]) == 0
    assert got == [["--staleness", "2", "--", "x"]]


def test_ablate_runs_the_ablation_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ablate`` is ``python -m benchmarks.ablation`` in its own process (the package imports no
    benchmark): its arguments are passed on and its exit status returned."""
    monkeypatch.chdir(ROOT)
    assert cli.main(["ablate", "--staleness", "x"]) == 2   # the benchmark's own one-line refusal
    assert cli.main(["ablate", "--help"]) == 0


def test_ablate_away_from_the_repository_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["ablate"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "run pipeline-rl ablate from the repository root" in err[0], err


def test_help_lists_the_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in ("run", "ablate")) and "{run,ablate}" in out, out


@pytest.mark.parametrize("argv, says", [
    (["train"], "train: unknown subcommand (choose from run, ablate"),
    (["--staleness", "2"], "--staleness: unknown subcommand"),
    (["eval"], "eval: there is no evaluation of a checkpoint on its own"),
    ([], "name a subcommand: run, ablate"),
])
def test_a_missing_or_unknown_subcommand_is_one_line_exit_2(argv: list[str], says: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert captured.out == "" and len(err) == 1 and err[0].startswith("pipeline-rl: error: ") and says in err[0], err


def test_python_m_runs_the_command() -> None:
    """``python -m pipeline_rl.cli`` (no installed script needed): an unknown subcommand, exit 2."""
    proc = subprocess.run([sys.executable, "-m", "pipeline_rl.cli", "nope"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "nope: unknown subcommand" in proc.stderr
