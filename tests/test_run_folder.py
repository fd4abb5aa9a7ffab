"""One folder per run: runs never mix, a resumed run continues its own folder, and the
step-0 evaluation is of the starting weights alone."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from pipeline_rl.run.run_folder import RunFolderError, open_run_folder
from tiny_run import tiny_run_config


def _rows(file: Path, steps: list[int], **extra: float) -> None:
    file.write_text("".join(json.dumps({"step": s, "time_s": 1.5 * s, **extra}) + "\n" for s in steps))


def test_each_run_gets_a_new_folder_and_latest_follows(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    (runs / "latest").mkdir(parents=True)                    # an older version's single folder
    (runs / "latest" / "metrics.jsonl").write_text("")
    first = open_run_folder(None, None, runs=runs).path
    second = open_run_folder(None, None, runs=runs).path
    assert first != second and first.parent == second.parent == runs
    assert (runs / "latest").is_symlink() and (runs / "latest").resolve() == second.resolve()
    assert any(p.name.endswith("-old") and (p / "metrics.jsonl").exists() for p in runs.iterdir())


def test_a_folder_that_holds_a_run_is_refused(tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    open_run_folder(str(taken), None)
    with pytest.raises(RunFolderError) as e:
        open_run_folder(str(taken), None)
    assert str(e.value).startswith(f"--out-dir: {taken} already holds a run") and "\n" not in str(e.value)


def test_resume_continues_its_own_folder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000006").mkdir(parents=True)
    _rows(run / "metrics.jsonl", list(range(1, 11)))
    _rows(run / "eval.jsonl", [0, 5, 10])
    folder = open_run_folder(None, str(run / "checkpoints" / "step_000006"), 6)
    assert folder.path == run and folder.resumed_at == 6 and folder.elapsed_s == 9.0
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert [json.loads(x)["step"] for x in (run / "eval.jsonl").read_text().splitlines()] == [0, 5]
    assert "resuming at step 6" in folder.line() and "5 rows past step 6 dropped" in folder.line()
    assert len(json.loads((run / "run.json").read_text())["segments"]) == 1
    with pytest.raises(RunFolderError):   # --out-dir may only name the checkpoint's own run
        open_run_folder(str(run), str(tmp_path / "elsewhere" / "checkpoints" / "step_000001"), 1)


@pytest.mark.slow
def test_two_default_runs_never_mix(ray_local: None, tiny_model_dir: str, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs of the launcher's entry point into the default location: two complete,
    separate folders, each summary from its own run, each step-0 evaluation of v0 alone."""
    from pipeline_rl.driver import run

    monkeypatch.chdir(tmp_path)
    summaries = []
    for steps in (4, 6):
        cfg = tiny_run_config(tiny_model_dir, tmp_path, "--max-steps", str(steps), "--eval.every", "3",
                              "--eval.num_prompts", "8", "--eval.k", "2").model_copy(update={"out_dir": None})
        assert run(cfg) == 0
        summaries.append(capsys.readouterr().out)
    folders = sorted(p for p in (tmp_path / "runs").iterdir() if not p.is_symlink())
    assert len(folders) == 2 and os.readlink(tmp_path / "runs" / "latest") == folders[1].name
    for folder, steps, summary in zip(folders, (4, 6), summaries):
        rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        evals = [json.loads(x) for x in (folder / "eval.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, steps + 1))
        assert [e["step"] for e in evals] == [0, 3, steps][: 2 if steps == 3 else 3]
        assert evals[0]["version_min"] == evals[0]["version_max"] == 0
        assert re.search(rf"\| steps +\| {steps} \|", summary), summary
        first_eval = f"{evals[0]['greedy_accuracy']:.3f} -> {evals[-1]['greedy_accuracy']:.3f}"
        assert f"held-out greedy accuracy (step 0 -> {steps})" in summary and first_eval in summary
        assert (folder / "checkpoints" / f"step_{steps:06d}").is_dir() and (folder / "logs").is_dir()
