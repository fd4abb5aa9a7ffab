"""benchmarks/peers.py: the figures of a run from its curve, bad flags, how each side is
installed, and (slow) a real side-by-side on a tiny model -- TRL's GRPOTrainer and the
project's pipeline (Ray, vLLM, DeepSpeed, ZeroMQ), each in its own process, with the JSON,
Markdown and PNG outputs. The side-by-side runs TRL from the project's environment
(``--trl-env project``): the clean one (``benchmarks/peers_env.py``) is built by the
benchmark itself, minutes of downloads the suite does not make."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import peers, peers_env
from benchmarks.common import portable


def test_trailing_mean_uses_full_windows_only() -> None:
    assert peers.trailing([1.0, 0.0, 1.0, 1.0], 2) == [None, 0.5, 0.5, 1.0]


def test_figures_of_a_run() -> None:
    s = peers.Settings(4, 2, 4, 2e-4, 16, 256, 1.0, (), 2, "/m", False)
    curve = peers.Curve(unix_time_s=[110.0, 111.0, 112.0, 113.0], time_s=[1.0, 2.0, 3.0, 4.0],
                        reward=[0.0, 1.0, 1.0, 1.0], completion_len=[5.0, 5.0, 5.0, 5.0])
    r = peers.measure("s2", 0, 100.0, curve, 14.0, s, target=0.9, window=2, error=None)
    assert r.ok and r.steps == 4 and r.steps_to_target == 3
    assert r.train_s_to_target == 3.0 and r.wall_s_to_target == 12.0
    assert r.startup_s == pytest.approx(9.0)  # training started at 109 s, the command at 100 s
    assert r.step_time_s == 1.0 and r.tokens_per_s == pytest.approx(4 * 5 * 8 / 4.0)
    never = peers.measure("trl", 0, 100.0, curve, 14.0, s, target=2.0, window=2, error=None)
    assert never.steps_to_target is None and never.wall_s_to_target is None
    failed = peers.measure("trl", 0, 100.0, None, 1.0, s, 0.8, 2, "exit status 1")
    assert not failed.ok and failed.error == "exit status 1"


def test_a_target_trl_never_reached_bounds_the_ratio_and_a_report_is_rebuilt(tmp_path: Path) -> None:
    """TRL below the held-out target at its last evaluation: the ratio is below ours over that
    evaluation's time; ``--report`` rebuilds a finished comparison's report from its JSON."""
    s = peers.Settings(4, 2, 4, 2e-4, 16, 256, 1.0, (), 2, "/m", False)
    def curve(greedy: list[float]) -> peers.Curve:
        evals = [peers.HeldOut(step, 100.0 * step, 1000.0 + 100.0 * step, g) for step, g in zip((0, 2, 4), greedy)]
        return peers.Curve(unix_time_s=[1000.0 + 100.0 * i for i in range(1, 5)], time_s=[100.0 * i for i in range(1, 5)],
                           reward=[0.0] * 4, completion_len=[5.0] * 4, evals=evals)
    trl = peers.measure("trl", 0, 1000.0, curve([0.1, 0.2, 0.3]), 500.0, s, 0.9, 2, None, heldout_target=0.5)
    ours = peers.measure("s2", 0, 1000.0, curve([0.1, 0.6, 0.9]), 500.0, s, 0.9, 2, None, heldout_target=0.5)
    assert trl.heldout_train_s_to_target is None and trl.heldout_train_s_last == 400.0
    ratios = peers.summarize([trl, ours])["ratios_vs_trl"]["s2"]
    assert ratios["heldout_train_s_to_target"] is None and ratios["heldout_train_s_to_target_bound"] == 0.5
    result = {"hardware": {"cpu": "x", "cores": 2, "memory_gib": 1}, "installs": {},
              "settings": {**peers.asdict(s), "seeds": [0], "target": 0.9, "heldout_target": 0.5, "window": 2,
                           "systems": ["trl", "s2"], "eval_prompts": 4, "eval_every": 2},
              "runs": [peers.asdict(trl), peers.asdict(ours)], "curves": []}
    (tmp_path / "peers.json").write_text(json.dumps(result))
    assert "| < 0.50, < 0.50 |" in peers.report(tmp_path / "peers.json").md


def test_each_side_names_its_environment_and_versions() -> None:
    assert peers.label("s2") == "pipeline_rl --staleness 2"
    assert peers.label("s2-noeval") == "pipeline_rl --staleness 2 --eval.every 0"
    s = peers.Settings(4, 2, 4, 2e-4, 16, 256, 1.0, (), 2, "/m", True, "/venv/bin/python")
    assert peers.command("trl", 0, s, Path("/r"))[0] == "/venv/bin/python"
    assert "--eval.every" not in peers.command("s2", 0, s, Path("/r"))
    assert peers.command("s2-noeval", 0, s, Path("/r"))[-4:-2] == ["--eval.every", "0"]
    pins = peers_env.pins()
    assert "trl==1.16.0" in pins and any(p.startswith("transformers==") for p in pins)
    assert not any(p.startswith("vllm") for p in pins) and peers_env.TORCH in peers_env.stamp()
    info = {"prefix": "/v", "versions": {"torch": "2.13.0+cpu", "trl": "1.16.0", "vllm": None}}
    assert peers_env.describe("TRL", info) == "TRL: /v (torch 2.13.0+cpu, trl 1.16.0; no vllm)"


@pytest.mark.parametrize(("argv", "message"), [
    (["--systems", "trl,vllm"], "--systems: unknown value(s) vllm"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--n", "1"], "--n must be >= 2"),
    (["--", "--trainer.lr", "1"], "only --task.* flags may follow '--'"),
])
def test_bad_flag_is_one_line_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        peers.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_trl_and_pipeline_side_by_side_on_a_tiny_model(tiny_model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "peers"
    code = peers.main(["--model", tiny_model_dir, "--systems", "trl,s2", "--trl-env", "project", "--seeds", "1", "--steps", "3",
                       "--window", "2", "--target", "0", "--max-new-tokens", "8", "--prompts", "2", "--n", "4",
                       "--timeout-s", "600", "--out", str(out), "--eval-every", "2", "--eval-prompts", "4",
                       "--heldout-target", "0"])
    logs = {p.name: p.read_text()[-2000:] for p in out.glob("*/console.log")}
    assert code == 0, logs
    result = json.loads((out / "peers.json").read_text())
    assert [(r["system"], r["steps"], r["steps_to_target"]) for r in result["runs"]] == [("trl", 3, 2), ("s2", 3, 2)]
    for r in result["runs"]:
        assert r["ok"] and r["startup_s"] > 0 and r["tokens_per_s"] > 0 and r["wall_s_to_target"] > r["train_s_to_target"]
    assert set(result["summary"]["ratios_vs_trl"]) == {"s2"}
    # Both sides evaluated the same held-out prompts, from the start: target 0 is met at step 0.
    for r in result["runs"]:
        assert r["greedy_first"] is not None and r["heldout_steps_to_target"] == 0, r
    trl_evals = [json.loads(line) for line in (out / "trl_seed0" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in trl_evals] == [0, 2, 3] and all(e["num_prompts"] == 4 for e in trl_evals)
    md = (out / "peers.md").read_text()
    assert "Held-out greedy accuracy (4 prompts" in md
    # Where each side ran, written as anyone's path (a results page is read on other machines).
    assert "TRL GRPOTrainer" in md and f"pipeline_rl: {portable(sys.prefix)} (" in md
    assert (out / "peers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
