"""One folder per run: runs never mix, a resumed run continues its own folder, and the
step-0 evaluation is of the starting weights alone."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from pipeline_rl.config import Config
from pipeline_rl.metrics import MetricsLogger, StepMetrics
from pipeline_rl.run.life.run_folder import RunFolderError, open_run_folder, read_resumes, resolve_resume, restart_in
from pipeline_rl.training.checkpoint import RunState, write_run_state
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
    assert "resume 1, at step 6" in folder.line() and "4 step rows, 1 evaluation(s)" in folder.line()
    assert len(json.loads((run / "run.json").read_text())["segments"]) == 1
    assert [(m.number, m.resumed_at, m.dropped_steps, m.dropped_evals) for m in read_resumes(run)] == [(1, 6, 4, 1)]
    with pytest.raises(RunFolderError):   # --out-dir may only name the checkpoint's own run
        open_run_folder(str(run), str(tmp_path / "elsewhere" / "checkpoints" / "step_000001"), 1)


def step_metrics(step: int) -> StepMetrics:
    return StepMetrics(step=step, version=step, time_s=1.5 * step, reward_mean=0.5, tokens_per_s=1.0, lag_mean=0.0,
                       lag_max=0, evicted=0, mismatch_kl=0.0, masked_frac=0.0, mixed_version_frac=0.0,
                       trainer_idle_frac=0.0, weight_update_stall_ms=0.0, step_time_s=1.5, loss=0.1, buffer_fill=0,
                       completion_len_mean=3.0)


def _events(run: Path) -> list[tuple[int, str]]:
    """``(step, tag)`` of every value in the run's TensorBoard files, read by TensorBoard's own loader."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [(e.step, v.tag) for f in sorted((run / "tb").glob("*tfevents*"))
            for e in EventFileLoader(str(f)).Load() for v in e.summary.value]


def test_resumed_again_and_again_tensorboard_keeps_one_curve_and_marks_each_resume(tmp_path: Path) -> None:
    """Resumed at 6, then at 4: TensorBoard drops what each resume redoes, as the JSON
    records do, and each resume is a mark (a resumes.jsonl line, run/resumes, run/resume)."""
    from pipeline_rl.metrics import EvalMetrics

    run = tmp_path / "run"
    logger = MetricsLogger(run, stream=open(os.devnull, "w"))
    for step in range(1, 11):
        logger.log(step_metrics(step))
        if step % 5 == 0:
            logger.log_eval(EvalMetrics(step, step, 1.0, 0.5, 0.5, 0.5, 2, 8, step, step, 0.1, 3.0))
    logger.close()
    (run / "checkpoints").mkdir()
    for version, segment_end in ((6, 9), (4, 8)):
        folder = open_run_folder(None, str(run / "checkpoints" / f"step_{version:06d}"), version)
        logger = MetricsLogger(run, stream=open(os.devnull, "w"))
        assert folder.mark is not None
        logger.log_resume(folder.mark.number, version, folder.line())
        for step in range(version + 1, segment_end + 1):
            logger.log(step_metrics(step))
        logger.close()
    losses = [s for s, tag in _events(run) if tag == "loss"]
    assert losses == sorted(set(losses)) == list(range(1, 9))
    assert [s for s, tag in _events(run) if tag == "eval/greedy_accuracy"] == []   # 5 and 10: both redone
    assert [s for s, tag in _events(run) if tag == "run/resumes"] == [4]           # the mark at 6 was redone too
    assert [(m.number, m.resumed_at) for m in read_resumes(run)] == [(1, 6), (2, 4)]
    assert read_resumes(run)[1].dropped_events == 5 + 1 + 1   # steps 5..9, the evaluation at 5, the mark at 6


def _checkpoint(folder: Path, version: int, complete: bool = True) -> Path:
    """A folder that passes ``read_run_state`` (``complete``) or lacks its run state (a killed save)."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(folder / "model.safetensors"))
    (folder / "deepspeed" / "state").mkdir(parents=True)
    (folder / "deepspeed" / "state" / "optim.pt").write_bytes(b"x")
    if complete:
        write_run_state(folder, RunState(version=version, data_position=2 * version, world_size=1, zero_stage=0))
    return folder


def test_resume_a_run_folder_takes_its_newest_complete_checkpoint_and_tidies_killed_saves(tmp_path: Path) -> None:
    """``--resume RUN_DIR``: a save killed before its run state (``step_30.partial``) is
    removed, never resumed; one killed while replacing ``step_20`` (only ``.old`` and a
    finished ``.partial`` left) is put back; the newest complete checkpoint resumes."""
    ckpts = tmp_path / "run" / "checkpoints"
    _checkpoint(ckpts / "step_000010", 10)
    _checkpoint(ckpts / "step_000020.old", 20)
    _checkpoint(ckpts / "step_000020.partial", 20)
    _checkpoint(ckpts / "step_000030.partial", 30, complete=False)
    cfg = Config.model_validate({"resume": str(tmp_path / "run")})
    assert resolve_resume(cfg).resume == str(ckpts / "step_000020")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000010", "step_000020"]
    named = Config.model_validate({"resume": str(ckpts / "step_000010")})
    assert resolve_resume(named) == named                          # a checkpoint stands for itself
    empty = tmp_path / "empty"
    (empty / "checkpoints" / "step_000005.partial").mkdir(parents=True)
    with pytest.raises(RunFolderError) as e:
        resolve_resume(Config.model_validate({"resume": str(empty)}))
    assert "without a complete checkpoint" in str(e.value) and "\n" not in str(e.value)


def test_a_resume_from_an_older_checkpoint_moves_the_later_ones_aside_and_restarts_stay_on_its_timeline(
        tmp_path: Path) -> None:
    """Checkpoints reached step 40 (and a save of 50 was killed); the run resumes at 20:
    step_30, step_40 and step_50.partial are moved, not deleted, to abandoned/resume_1, the
    ``best`` link (at 40) goes, and a restart (a trainer kill) goes back to step_20, then to
    the new timeline's own step_30, never to the abandoned step_40."""
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    for v in (10, 20, 30, 40):
        _checkpoint(ckpts / f"step_{v:06d}", v)
    _checkpoint(ckpts / "step_000050.partial", 50, complete=False)
    (ckpts / "best").symlink_to("step_000040")
    _rows(run / "metrics.jsonl", list(range(1, 41)))
    resume = resolve_resume(Config.model_validate({"resume": str(ckpts / "step_000020")})).resume
    folder = open_run_folder(None, resume, 20)
    moved = run / "abandoned" / "resume_1"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000010", "step_000020"]
    assert sorted(p.name for p in moved.iterdir()) == ["step_000030", "step_000040", "step_000050.partial"]
    assert folder.mark is not None and folder.mark.abandoned == ["step_000030", "step_000040", "step_000050.partial"]
    assert f"3 later checkpoint(s) moved to {moved}" in folder.line()
    assert read_resumes(run)[0].abandoned_to == "abandoned/resume_1"
    assert restart_in(run)[1] == str(ckpts / "step_000020")
    _checkpoint(ckpts / "step_000030", 30)                  # the new timeline's own step 30
    assert restart_in(run)[1] == str(ckpts / "step_000030")
    assert (moved / "step_000040" / "run_state.json").is_file() and not (ckpts / "step_000040").exists()
    assert [m.abandoned for m in read_resumes(run)] == [folder.mark.abandoned, [], []]


def test_resume_of_a_run_folder_without_a_checkpoint_is_one_line(tiny_model_dir: str, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline_rl.driver import run

    empty = tmp_path / "run"
    (empty / "checkpoints" / "step_000005.partial").mkdir(parents=True)   # a first save, killed
    assert run(tiny_run_config(tiny_model_dir, empty, "--resume", str(empty))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"async_grpo.py: error: --resume: {empty} is a run folder without a complete checkpoint in " \
                      f"{empty / 'checkpoints'}"


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
