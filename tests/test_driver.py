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


def _model_copy(src: str, dst: Path, *, drop: tuple[str, ...] = (), config: dict[str, object] | None = None) -> Path:
    import shutil

    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink()
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


@pytest.mark.parametrize("case, needle", [
    ("missing", "no such folder"),
    ("file", "is a file"),
    ("no_config", "has no config.json"),
    ("not_causal", "holds a BertModel, not a causal language model"),
    ("unknown_arch", "vLLM has no implementation of MadeUpForCausalLM"),
    ("no_tokenizer", "has no usable tokenizer"),
])
def test_bad_model_folder_is_one_line_error(case: str, needle: str, tmp_path: Path, tiny_model_dir: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A model folder the run cannot use is one line naming --model.path, exit status 2,
    and nothing starts."""
    folder = tmp_path / "model"
    if case == "file":
        folder.write_text("not a folder")
    elif case == "no_config":
        _model_copy(tiny_model_dir, folder, drop=("config.json",))
    elif case == "not_causal":
        _model_copy(tiny_model_dir, folder, config={"architectures": ["BertModel"]})
    elif case == "unknown_arch":
        _model_copy(tiny_model_dir, folder, config={"architectures": ["MadeUpForCausalLM"]})
    elif case == "no_tokenizer":
        _model_copy(tiny_model_dir, folder, drop=("tokenizer.json", "tokenizer_config.json",
                                                  "special_tokens_map.json"))
    cfg, _ = parse_config(["--model", str(folder), "--out-dir", str(tmp_path / "out")], check_cpu=False)
    assert run(cfg) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and err[0].startswith("async_grpo.py: error: --model.path: "), err
    assert needle in err[0], err
    assert not (tmp_path / "out").exists()


def test_resources_checked_against_the_cluster() -> None:
    """A cluster short of CPUs, or without a declared custom resource, is one line naming
    what is missing; a fitting one passes."""
    from pipeline_rl.resources import check_cluster, cpus_needed

    cfg, _ = parse_config(["--rollout.num_workers", "2", "--trainer.num_ranks", "2",
                           "--trainer.batch_size", "64", "--ray.rollout_resource", "gen"], check_cpu=False)
    assert cpus_needed(cfg) == 4
    short = check_cluster(cfg, {"CPU": 2.0, "gen": 1.0})
    assert short is not None and "has 2 CPUs, the run needs 4" in short and "\n" not in short
    missing = check_cluster(cfg, {"CPU": 8.0})
    assert missing == "--ray.rollout_resource: no node of the Ray cluster declares the resource 'gen'"
    assert check_cluster(cfg, {"CPU": 4.0, "gen": 1.0}) is None


def test_bf16_generation_on_a_cpu_without_bf16_instructions_is_said() -> None:
    """bfloat16 generation on an x86 CPU whose flags list neither avx512_bf16 nor amx_bf16 gets
    one line; float32, a CPU with either flag, or a CPU with no x86 flags list gets none."""
    from pipeline_rl.resources import cpu_has_bf16, slow_bf16_line

    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma\n"
    amx = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    zen4 = "flags\t\t: fpu avx2 avx512f avx512_bf16\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16\n"
    assert (cpu_has_bf16(avx2), cpu_has_bf16(amx), cpu_has_bf16(zen4), cpu_has_bf16(arm)) == (False, True, True, None)
    line = slow_bf16_line("bfloat16", avx2)
    assert line is not None and "avx512_bf16" in line and "slower than float32" in line and "\n" not in line
    assert slow_bf16_line("float32", avx2) is None and slow_bf16_line("auto", avx2) is None
    assert slow_bf16_line("bfloat16", amx) is None and slow_bf16_line("bfloat16", arm) is None
    assert slow_bf16_line("bfloat16", "") is None


def test_supervision_names_the_innermost_actor() -> None:
    """The failure text of a Ray error raised through two actors names the innermost one."""
    from pipeline_rl.run.life.supervise import Watchdog, describe_failure

    class Chained(RuntimeError):
        pass

    outer = Chained("ray::TrainerActor.train_step() (pid=1)\n  ...\nray::BufferActor.get_batch() (pid=2)")
    outer.cause = ValueError("boom")  # type: ignore[attr-defined]
    assert describe_failure(outer, "trainer") == "replay buffer failed: ValueError: boom"
    assert describe_failure(KeyError("k"), "trainer") == "trainer failed: KeyError: 'k'"
    dog = Watchdog(floor_s=30.0)
    assert dog.bound_s() == 30.0 and not dog.overdue()
    for _ in range(5):
        dog.step_done(2.0)
    assert dog.bound_s() == 40.0  # 20 x the median step time, above the floor


def test_watchdog_extends_a_few_times_while_only_equal_reward_groups_arrive() -> None:
    """--algorithm.skip_zero_variance: a stretch of dropped groups restarts the watchdog's
    clock at most max_extensions times in a row; a completed step resets the count."""
    assert parse_config(["--algorithm.skip_zero_variance", "true"])[0].algorithm.skip_zero_variance
    assert not parse_config([])[0].algorithm.skip_zero_variance    # off by default
    from pipeline_rl.run.life.supervise import Watchdog

    dog = Watchdog(floor_s=30.0, max_extensions=2)
    assert dog.extend() and dog.extend() and not dog.extend()
    dog.step_done(1.0)
    assert dog.extensions == 0 and dog.extend() and dog.waited_s() < 1.0



def test_core_plan_gives_each_worker_and_rank_a_core_of_its_own_on_one_cpu_machine() -> None:
    """One slot per worker then per rank, all distinct, on one CPU machine; none on a
    cluster of several nodes, on GPUs, or with --ray.pin_cores false."""
    from pipeline_rl.resources import CoreSlot, plan_cores

    cfg, _ = parse_config(["--rollout.num_workers", "2", "--trainer.num_ranks", "2",
                           "--trainer.batch_size", "64"], check_cpu=False)
    plan = plan_cores(cfg, alive_nodes=1, on_gpus=False)
    assert plan.pinned
    assert plan.workers == (CoreSlot(0, 4), CoreSlot(1, 4))
    assert plan.ranks == (CoreSlot(2, 4), CoreSlot(3, 4))
    for unpinned in (plan_cores(cfg, alive_nodes=2, on_gpus=False), plan_cores(cfg, alive_nodes=1, on_gpus=True),
                     plan_cores(cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"pin_cores": False})}),
                                alive_nodes=1, on_gpus=False)):
        assert not unpinned.pinned
        assert unpinned.workers == (None, None) and unpinned.ranks == (None, None)
    with pytest.raises(ValueError, match="core slot 2 outside 0..1"):
        CoreSlot(2, 2)
