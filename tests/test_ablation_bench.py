"""benchmarks/ablation.py end to end: a mini grid (2 staleness x 2 corrections x 1
seed, 2 steps per cell) through the real pipeline (Ray, vLLM, DeepSpeed, ZeroMQ) on a
tiny model, its cells as Ray tasks on a real two-node Ray cluster on this machine, in
the script's supervised child process; the JSON schema, the Markdown and PNG outputs,
placement on both nodes, and cell-by-cell resume (a rerun skips finished cells and
starts no Ray). One seed keeps the run to four cells (each is a whole pipeline start);
how seeds multiply the cells is checked on the grid itself, and the statistics over
seeds on synthetic cells (``test_ablation_stats.py``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import ablation
from benchmarks.ablation_cells import Arm, Cell
from ray_cluster import two_node_cluster

CELL_KEYS = {"name", "arm", "seed", "status", "steps", "wall_s", "node", "start_reward", "final_reward",
             "reward_auc", "peak_reward", "trough_reward", "steps_to_threshold", "time_to_threshold_s",
             "collapsed", "mismatch_kl_k3_mean", "ess_mean", "masked_token_frac_mean", "masked_seq_frac_mean",
             "lag_mean", "error", "curves"}
CURVE_KEYS = {"step", "time_s", "reward", "mismatch_kl_k1", "mismatch_kl_k3", "masked_token_frac",
              "masked_seq_frac", "lag_mean", "loss", "ess"}
ARM_KEYS = {"arm", "seeds", "done", "collapsed", "reached", "final_reward", "reward_auc", "steps_to_threshold",
            "mismatch_kl_k3_mean", "ess_mean", "masked_token_frac_mean", "masked_seq_frac_mean", "lag_mean"}


def test_bad_grid_flag_is_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        ablation.main(["--corrections", "tis,bogus"])
    assert e.value.code == 2
    assert "--corrections: unknown value(s) bogus" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--alpha", "1.5"], "--alpha must be in (0, 1)"),
    (["--", "--ray.trainer_resource", "gpu_node"], "give the cluster with --ray-address"),
])
def test_bad_seed_alpha_or_placement_flag_is_one_line_error(flags: list[str], message: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        ablation.main(flags)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_the_grid_is_staleness_by_correction_by_seed_and_each_cell_carries_its_flags() -> None:
    cells = ablation.grid("0,2", "none,tis", "bf16", [0, 1])
    assert [c.name for c in cells] == [f"bf16_s{k}_{c}_seed{s}" for k in (0, 2) for c in ("none", "tis")
                                       for s in (0, 1)]
    assert cells[5] == Cell(Arm("bfloat16", 2, "none"), 1)
    flags = cells[5].flags()
    assert flags[flags.index("--staleness") + 1] == "2" and flags[flags.index("--seed") + 1] == "1"


@pytest.mark.slow
def test_mini_grid_on_a_two_node_cluster_and_resume(tiny_model_dir: str, tmp_path: Path,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "abl"
    with two_node_cluster(node_cpus=2) as cluster:
        argv = ["--model", tiny_model_dir, "--staleness", "0", "--corrections", "none,tis",
                "--dtypes", "bf16", "--seeds", "1", "--steps", "2", "--ray-address", cluster.address,
                "--out", str(out), "--json", str(tmp_path / "a.json"), "--",
                "--rollout.n", "4", "--trainer.batch_size", "8", "--trainer.micro_batch_size", "8",
                "--rollout.max_new_tokens", "8", "--rollout.max_num_seqs", "16",
                "--trainer.batch_timeout_s", "120"]
        assert ablation.main(argv) == 0
    printed = capfd.readouterr().out
    assert "2 CPUs per cell, 2 cell(s) at once on 2 node(s)" in printed
    result = json.loads((tmp_path / "a.json").read_text())
    assert {"hardware", "settings", "wall_s", "cells_wall_s", "nodes", "arms", "cells"} <= result.keys()
    assert {"steps", "seeds", "threshold", "alpha", "test", "interval", "flags", "model_dir"} \
        <= result["settings"].keys()
    names = [c["name"] for c in result["cells"]]
    assert names == [f"bf16_s0_{c}_seed0" for c in ("none", "tis")]
    assert len(result["nodes"]) == 2  # cells ran on both nodes
    assert {c["node"] for c in result["cells"]} == set(result["nodes"])
    for c in result["cells"]:
        assert CELL_KEYS <= c.keys() and CURVE_KEYS <= c["curves"].keys()
        assert c["status"] == "done" and c["steps"] == 2 and c["curves"]["step"] == [1, 2]
        assert isinstance(c["collapsed"], bool) and 0.0 <= c["final_reward"] <= 1.0
        assert math.isfinite(c["mismatch_kl_k3_mean"]) and c["mismatch_kl_k3_mean"] > 0.0  # bf16 vs fp32
        assert (out / "cells" / c["name"] / "metrics.jsonl").is_file()
        assert not (out / "cells" / c["name"] / "checkpoints").exists()
    assert sorted(result["arms"]) == ["bf16_s0_none", "bf16_s0_tis"]
    for name, arm in result["arms"].items():
        assert ARM_KEYS <= arm.keys() and arm["done"] == 1 and arm["final_reward"]["n"] == 1
        assert ("vs_none" in arm) == name.endswith("_tis")
    assert result["arms"]["bf16_s0_none"]["lag_mean"]["mean"] == 0.0
    md = (out / "ablation.md").read_text()
    assert "| staleness | correction | final reward |" in md and "p (Holm)" in md and "Hardware:" in md
    for png in ("ablation_bf16.png", "ablation_final.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Resume: every cell is finished, so a rerun reuses them (and starts no Ray).
    first = (out / "cells" / "bf16_s0_tis_seed0" / "cell.json").stat().st_mtime_ns
    assert ablation.main(argv) == 0
    assert "2 already finished, 0 to run" in capfd.readouterr().out
    assert (out / "cells" / "bf16_s0_tis_seed0" / "cell.json").stat().st_mtime_ns == first
    again = json.loads((out / "ablation.json").read_text())
    assert [c["final_reward"] for c in again["cells"]] == [c["final_reward"] for c in result["cells"]]
