"""Smoke test of ``benchmarks/lora_sync.py`` on a tiny model (``--quick``) so it cannot rot: every
part it reports is there (bytes, gather, merged fold and load, native replace, generation under
updates with both servings, each having applied versions); no timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_lora_sync_benchmark_tiny(tmp_path: Path) -> None:
    from benchmarks import lora_sync as module

    out = tmp_path / "lora_sync.json"
    assert module.main(["--quick", "--reps", "1", "--rank", "4", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert 0 < res["bytes_adapter"] < res["bytes_full"] and res["merged_bytes"] < res["bytes_full"]
    for key in ("gather_adapter_s", "merged_merge_s", "merged_load_s", "full_load_s", "merged_swap_s",
                "full_swap_s", "native_replace_s"):
        assert res[key] > 0, key
    for serving in ("full", "merged"):
        gen = res["generation"][serving]
        assert gen["tokens_per_s"] > 0 and gen["versions"] >= 1, serving


def test_lora_sync_benchmark_bad_flag_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import lora_sync as module

    with pytest.raises(SystemExit) as exit_:
        module.main(["--quick", "--update-every-s", "0"])
    assert exit_.value.code == 2
    assert "--update-every-s must be >= 0.01, got 0.0" in capsys.readouterr().err
