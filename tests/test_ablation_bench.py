"""Smoke test of benchmarks/ablation.py: a 2-cell x 2-step grid through the real pipeline
(Ray, vLLM, DeepSpeed, ZeroMQ) on a tiny model, in the script's supervised child process;
the JSON schema, the Markdown and PNG outputs, and cell-by-cell resume (a rerun skips
finished cells and starts no Ray)."""

from __future__ import annotations

import math

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent

CELL_KEYS = {"name", "dtype", "staleness", "correction", "status", "steps", "wall_s", "start_reward",
             "final_reward", "peak_reward", "trough_reward", "steps_to_threshold", "time_to_threshold_s", "collapsed",
             "mismatch_kl_k3_mean", "masked_token_frac_mean", "masked_seq_frac_mean", "lag_mean", "error",
             "curves"}
CURVE_KEYS = {"step", "time_s", "reward", "mismatch_kl_k1", "mismatch_kl_k3", "masked_token_frac",
              "masked_seq_frac", "lag_mean", "loss"}


def _load() -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_ablation", ROOT / "benchmarks" / "ablation.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_bad_grid_flag_is_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    ablation = _load()
    with pytest.raises(SystemExit) as e:
        ablation.main(["--corrections", "tis,bogus"])
    assert e.value.code == 2
    assert "--corrections: unknown value(s) bogus" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_grid_end_to_end_and_resume(tiny_model_dir: str, tmp_path: Path,
                                         capfd: pytest.CaptureFixture[str]) -> None:
    ablation = _load()
    out = tmp_path / "abl"
    argv = ["--model", tiny_model_dir, "--staleness", "0,2", "--corrections", "tis", "--dtypes", "bf16",
            "--steps", "2", "--out", str(out), "--json", str(tmp_path / "a.json"), "--",
            "--rollout.n", "4", "--trainer.batch_size", "8", "--trainer.micro_batch_size", "8",
            "--rollout.max_new_tokens", "8", "--rollout.max_num_seqs", "16", "--trainer.batch_timeout_s", "120"]
    assert ablation.main(argv) == 0
    result = json.loads((tmp_path / "a.json").read_text())
    assert {"hardware", "settings", "wall_s", "cells_wall_s", "cells"} <= result.keys()
    assert {"steps", "seed", "threshold", "collapse_rule", "flags", "model_dir"} <= result["settings"].keys()
    assert [c["name"] for c in result["cells"]] == ["bf16_s0_tis", "bf16_s2_tis"]
    for c in result["cells"]:
        assert CELL_KEYS <= c.keys() and CURVE_KEYS <= c["curves"].keys()
        assert c["status"] == "done" and c["steps"] == 2 and c["curves"]["step"] == [1, 2]
        assert isinstance(c["collapsed"], bool) and 0.0 <= c["final_reward"] <= 1.0
        assert math.isfinite(c["mismatch_kl_k3_mean"]) and c["mismatch_kl_k3_mean"] > 0.0  # bf16 vs fp32
        assert (out / "cells" / c["name"] / "metrics.jsonl").is_file()
        assert not (out / "cells" / c["name"] / "checkpoints").exists()
    assert result["cells"][0]["lag_mean"] == 0.0
    md = (out / "ablation.md").read_text()
    assert "| staleness | correction | final reward |" in md and "Hardware:" in md
    for png in ("ablation_bf16.png", "ablation_final.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Resume: both cells are finished, so a rerun reuses them (and starts no Ray).
    first = (out / "cells" / "bf16_s0_tis" / "cell.json").stat().st_mtime_ns
    capfd.readouterr()
    assert ablation.main(argv) == 0
    assert "2 already finished, 0 to run" in capfd.readouterr().out
    assert (out / "cells" / "bf16_s0_tis" / "cell.json").stat().st_mtime_ns == first
    again = json.loads((out / "ablation.json").read_text())
    assert [c["final_reward"] for c in again["cells"]] == [c["final_reward"] for c in result["cells"]]
