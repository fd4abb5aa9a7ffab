"""``benchmarks.lora_vs_full``: a folder that is not a ``benchmarks.real_model`` run is refused
in one line (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import lora_vs_full


def test_a_folder_without_a_real_model_run_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "full").mkdir()
    with pytest.raises(SystemExit) as e:
        lora_vs_full.main(["--full", str(tmp_path / "full"), "--lora", str(tmp_path / "lora")])
    assert e.value.code == 2 and "not a benchmarks.real_model --out folder" in capsys.readouterr().err
