"""Start-up checks of the driver: user data is validated before any process starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline_rl.cli import parse_config
from pipeline_rl.driver import run


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("rows, needle", [
    ([{"prompt": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4"}], ":2"),
    ([{"prompt": "1+1=", "answer": "2"}, "{not json"], ":2"),
    ([{"prompt": "x" * 400, "answer": "2"}], ":1"),
])
def test_bad_dataset_is_one_line_error_at_start(rows: list[object], needle: str, tmp_path: Path,
                                                tiny_model_dir: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    data = _write(tmp_path / "data.jsonl", rows)
    cfg, _ = parse_config(["--model", tiny_model_dir, "--dataset", str(data),
                           "--out-dir", str(tmp_path / "out")], check_cpu=True)
    assert run(cfg) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and str(data) in err[0] and needle in err[0], err
    assert not (tmp_path / "out").exists()  # nothing started


def test_missing_dataset_file(tmp_path: Path, tiny_model_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    cfg, _ = parse_config(["--model", tiny_model_dir, "--dataset", str(tmp_path / "nope.jsonl")],
                          check_cpu=True)
    assert run(cfg) == 2
    assert "nope.jsonl" in capsys.readouterr().err
