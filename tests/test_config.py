"""The typed configuration and its command line: defaults, layering, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pipeline_rl.cli import UsageError, build_parser, parse_config
from pipeline_rl.config import AdamWConfig, Config, MuonConfig

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch" / "async_grpo.py"


def test_defaults_validate() -> None:
    cfg, dry = parse_config([], check_cpu=True)
    assert isinstance(cfg, Config) and not dry
    assert cfg.staleness == 2 and cfg.groups_per_step == cfg.trainer.batch_size // cfg.rollout.n


def test_flags_override_toml(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("staleness = 4\n[rollout]\nn = 4\n[correction]\ntype = 'icepop'\n")
    cfg, _ = parse_config(["--config", str(toml), "--rollout.n", "8"], check_cpu=True)
    assert cfg.staleness == 4 and cfg.rollout.n == 8 and cfg.correction.type == "icepop"


@pytest.mark.parametrize("argv, flag", [
    (["--staleness", "-1"], "--staleness"),
    (["--correction.type", "bogus"], "--correction.type"),
    (["--trainer.batch_size", "30", "--rollout.n", "8"], "--trainer.batch_size"),
    (["--correction.icepop_alpha", "0.9", "--correction.icepop_beta", "0.95"], "--correction.icepop"),
    (["--correction.seq_lo", "0.9", "--correction.seq_hi", "1.5", "--correction.seq_cap", "1.5",
      "--correction.seq_lo", "0.95"], None),
    (["--model.hidden_size", "64", "--model.num_heads", "3"], "--model.num_heads"),
    (["--rollout.temperature", "0"], "--rollout.temperature"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--staleness", "two"], "--staleness"),
    (["--config", "/nonexistent.toml"], "--config"),
    (["--trainer.pass_cost_tokens", "-1"], "--trainer.pass_cost_tokens"),
    (["--ray.pin_cores", "maybe"], "--ray.pin_cores"),
    (["--algorithm.skip_zero_variance", "maybe"], "--algorithm.skip_zero_variance"),
    (["--ray.preload", "false"], "--ray.preload"),      # removed (issue 43): an unknown flag
    (["--ray.dashboard", "true"], "--ray.dashboard"),
    (["--run.max_restarts", "-1"], "--run.max_restarts"),
    (["--trainer.keep_checkpoints", "-2"], "--trainer.keep_checkpoints"),
    (["--rollout.standby", "maybe"], "--rollout.standby"),
    (["--run.spare_trainers", "maybe"], "--run.spare_trainers"),
])
def test_bad_values_give_one_line_naming_the_flag(argv: list[str], flag: str | None) -> None:
    if flag is None:  # a valid combination: seq_lo < seq_hi
        parse_config(argv, check_cpu=True)
        return
    with pytest.raises(UsageError) as err:
        parse_config(argv, check_cpu=True)
    msg = str(err.value)
    assert "\n" not in msg and flag in msg, msg


def test_cpu_head_dim_is_checked() -> None:
    with pytest.raises(UsageError, match="head dimension 16"):
        parse_config(["--model.hidden_size", "128", "--model.num_heads", "8"], check_cpu=True)
    parse_config(["--model.hidden_size", "128", "--model.num_heads", "8"], check_cpu=False)


def test_help_lists_every_field_grouped() -> None:
    text = build_parser().format_help()
    for section, model in Config.model_fields.items():
        ann = model.annotation
        fields = getattr(ann, "model_fields", None)
        if fields is None:
            assert f"--{section.replace('_', '-')}" in text
            continue
        assert f"{section}:" in text
        for name in fields:
            assert f"--{section}.{name}" in text


def _launch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(LAUNCH), *args], capture_output=True, text=True, timeout=60)


def test_launch_help_and_dry_run() -> None:
    res = _launch("--help")
    assert res.returncode == 0 and "--correction.type" in res.stdout and "--staleness" in res.stdout
    res = _launch("--staleness", "0", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["staleness"] == 0


@pytest.mark.parametrize("argv", [
    ["--staleness", "-3"], ["--correction.type", "nope"], ["--trainer.batch_size", "12"],
    ["--correction.icepop_beta", "0.9"], ["--buffer.capacity_groups", "0"],
    ["--model.num_heads", "8"], ["--bogus"], ["--rollout.weight_path", "nccl"], ["--rollout.weight_path", "x"],
])
def test_launch_bad_invocations_exit_2_with_one_line(argv: list[str]) -> None:
    res = _launch(*argv)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("async_grpo.py: error: --"), res.stderr


def test_k1_kl_as_a_loss_term_is_refused() -> None:
    """k1's gradient as a loss term is that of log pi whatever the reference: refused in one line."""
    from pipeline_rl.cli import UsageError, parse_config

    with pytest.raises(UsageError, match=r"^--algorithm\.kl_estimator: k1 as a loss term"):
        parse_config(["--algorithm.kl_coef", "0.1", "--algorithm.kl_estimator", "k1"], check_cpu=False)
    cfg, _ = parse_config(["--algorithm.kl_estimator", "k1"], check_cpu=False)  # no penalty: fine
    assert cfg.algorithm.kl_estimator == "k1"


def test_constant_normalisation_far_above_the_length_warns() -> None:
    from pipeline_rl.cli import parse_config

    cfg, _ = parse_config(["--algorithm.normalization", "constant", "--algorithm.constant_length", "1024",
                           "--rollout.max_new_tokens", "16"], check_cpu=False)
    (warning,) = cfg.warnings()
    assert "64x" in warning and "gradient shrinks" in warning
    cfg, _ = parse_config(["--algorithm.normalization", "constant", "--algorithm.constant_length", "32",
                           "--rollout.max_new_tokens", "16"], check_cpu=False)
    assert cfg.warnings() == []


def test_cuda_without_a_gpu_is_one_line() -> None:
    with pytest.raises(UsageError) as e:
        parse_config(["--model.device", "cuda"], check_cpu=True)
    assert str(e.value) == "--model.device: cuda asked for, but this machine has no CUDA GPU"


def test_engine_dtype_auto_is_float32_on_cpu_and_bfloat16_on_cuda() -> None:
    from pipeline_rl.rollout.engines.engine import engine_config

    cfg, _ = parse_config([], check_cpu=True)
    assert engine_config(cfg.rollout, "m", device="cpu").dtype == "float32"
    assert engine_config(cfg.rollout, "m", device="cuda").dtype == "bfloat16"
    cfg, _ = parse_config(["--rollout.dtype", "bfloat16"], check_cpu=True)
    assert engine_config(cfg.rollout, "m", device="cpu").dtype == "bfloat16"


def test_kv_cache_is_sized_for_the_run_unless_given(tiny_model_dir: str) -> None:
    """Default: max_num_seqs full-length sequences of the model's K and V (fp32 on CPU), at
    least 1/64 GiB; a given size (fractions allowed) is used as is; an unreadable folder
    gets 1 GiB."""
    import json
    from pathlib import Path

    from pipeline_rl.rollout.engines.engine import MIN_AUTO_KV_GIB, engine_config

    spec = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    per_token = 2 * spec["num_hidden_layers"] * spec.get("num_key_value_heads", spec["num_attention_heads"]) * (
        spec.get("head_dim") or spec["hidden_size"] // spec["num_attention_heads"]) * 4
    cfg, _ = parse_config(["--rollout.max_num_seqs", "256", "--rollout.max_model_len", "4096"], check_cpu=True)
    got = engine_config(cfg.rollout, tiny_model_dir, device="cpu").kv_cache_gib
    assert got == pytest.approx(max(MIN_AUTO_KV_GIB, 256 * 4096 * per_token / 2**30))
    cfg, _ = parse_config(["--rollout.kv_cache_gib", "0.25"], check_cpu=True)
    assert engine_config(cfg.rollout, tiny_model_dir, device="cpu").kv_cache_gib == 0.25
    assert engine_config(cfg.rollout.model_copy(update={"kv_cache_gib": None}), "no/such/folder",
                         device="cpu").kv_cache_gib == 1.0
    with pytest.raises(UsageError, match="^--rollout.kv_cache_gib"):
        parse_config(["--rollout.kv_cache_gib", "0"], check_cpu=True)


def test_inprocess_engine_on_cuda_is_refused() -> None:
    with pytest.raises(UsageError, match="^--rollout.engine: inprocess runs on CPU only"):
        parse_config(["--rollout.engine", "inprocess", "--model.device", "cuda"], check_cpu=False)


def test_trainer_dtype_auto_is_bf16_on_a_gpu_only() -> None:
    from pipeline_rl.config import Config
    from pipeline_rl.training.deepspeed_setup import deepspeed_config

    cfg = Config()
    assert cfg.model.dtype == "auto"
    assert cfg.model.trainer_dtype("cuda") == "bfloat16" and cfg.model.trainer_dtype("cpu") == "float32"
    assert deepspeed_config(cfg, 1, "cuda")["bf16"] == {"enabled": True}
    assert "bf16" not in deepspeed_config(cfg, 1, "cpu")
    cfg.model.dtype = "float32"
    assert cfg.model.trainer_dtype("cuda") == "float32"


@pytest.mark.parametrize("argv, toml, new", [
    (["--rollout.max_restarts", "3"], "[rollout]\nmax_restarts = 3\n", "--run.max_worker_restarts"),
    (["--trainer.muon_lr=0.02"], "[trainer]\nmuon_lr = 0.02\n", "--trainer.optimizer.lr"),
    (["--trainer.muon_momentum", "0.9"], "[trainer]\nmuon_momentum = 0.9\n", "--trainer.optimizer.momentum"),
])
def test_a_renamed_key_is_one_line_naming_the_new_one(tmp_path: Path, argv: list[str], toml: str,
                                                      new: str) -> None:
    file = tmp_path / "old.toml"
    file.write_text(toml)
    for args in (argv, ["--config", str(file)]):
        with pytest.raises(UsageError) as e:
            parse_config(args, check_cpu=False)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(argv[0].split("=")[0] + ": renamed; use " + new), msg
    with pytest.raises(ValueError, match=f"renamed; use {new}"):   # a dict from Python, too
        Config.model_validate(tomllib.loads(toml))


def test_the_restart_limits_and_the_optimizer_choice_parse(tmp_path: Path) -> None:
    cfg, _ = parse_config(["--run.max_restarts", "1", "--run.max_worker_restarts", "5"], check_cpu=False)
    assert (cfg.run.max_restarts, cfg.run.max_worker_restarts) == (1, 5)
    cfg, _ = parse_config(["--trainer.optimizer", "muon", "--trainer.optimizer.lr", "0.02",
                           "--trainer.optimizer.momentum", "0.9"], check_cpu=False)
    assert cfg.trainer.optimizer == MuonConfig(lr=0.02, momentum=0.9)
    file = tmp_path / "muon.toml"
    file.write_text("[trainer]\noptimizer = 'muon'\n")   # a bare choice is its table; a flag adds to it
    cfg, _ = parse_config(["--config", str(file), "--trainer.optimizer.momentum", "0.5"], check_cpu=False)
    assert cfg.trainer.optimizer == MuonConfig(momentum=0.5)
    assert Config.model_validate({"trainer": {"optimizer": "adamw"}}).trainer.optimizer == AdamWConfig()
    text = build_parser().format_help()
    assert "--trainer.optimizer {adamw,muon}" in text and "--trainer.optimizer.type" not in text
    assert "--trainer.optimizer.lr FLOAT" in text and "--trainer.optimizer.momentum FLOAT" in text
