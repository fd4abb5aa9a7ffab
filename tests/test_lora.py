"""LoRA (``--lora.*``) in the trainer and its checkpoints, on CPU with real DeepSpeed and PEFT
and the tiny Llama: bad flags before Ray; only the adapter trains and is published; the KL
reference is the adapter switched off; checkpoints in PEFT's format that load in peft and give
the trainer's log-probs; resume; the merged model; ZeRO-3 over two ranks."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.synthetic import synthetic_groups
from pipeline_rl.cli import UsageError, parse_config
from pipeline_rl.config import Config
from pipeline_rl.net import rendezvous_port


def lora_cfg(**over: Any) -> Config:
    """4 groups x 4 completions, a rank-4 adapter on every projection."""
    trainer = {"batch_size": 16, "micro_batch_size": 16, "lr": 1e-2, **over.pop("trainer", {})}
    return Config.model_validate({
        "rollout": {"n": 4}, "correction": {"type": "none"}, "trainer": trainer,
        "lora": {"rank": 4, **over.pop("lora", {})}, **over})


def steps(trainer: Any, n: int, first: int = 0) -> list[float]:
    return [trainer.step(synthetic_groups(4, 4, seed=100 + s, version=s)).loss for s in range(first, first + n)]


def adapter_of(trainer: Any) -> dict[str, np.ndarray]:
    u = trainer.weights()
    return {n: a.copy() for n, a in zip(u.names, u.arrays, strict=True)}


def flat_logprobs(trainer_or_lists: Any, groups: Any) -> np.ndarray:
    lists = trainer_or_lists.logprobs(groups) if hasattr(trainer_or_lists, "logprobs") else trainer_or_lists
    return np.concatenate([lp for per_group in lists for lp in per_group])


def hf_logprobs(model: Any, groups: Any) -> np.ndarray:
    """Each completion's token log-probs under a transformers/peft model, at temperature 1."""
    out = []
    with torch.no_grad():
        for g in groups:
            for c in g.completions:
                ids = torch.from_numpy(np.concatenate([g.prompt_ids, c.token_ids])).long()[None]
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                n = len(c.token_ids)
                out.append(logp[-n:].gather(-1, ids[0, -n:, None])[:, 0].numpy())
    return np.concatenate(out)


@pytest.fixture
def make_trainer(tiny_model_dir: str) -> Any:
    from pipeline_rl.training.trainer import Trainer

    made: list[Any] = []

    def make(cfg: Config) -> Any:
        made.append(Trainer(cfg, tiny_model_dir))
        return made[-1]

    yield make
    for t in made:
        t.close()


# ------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("argv, needle", [
    (["--lora.rank", "-1"], "--lora.rank: Input should be greater than or equal to 0"),
    (["--lora.rank", "4", "--lora.target_modules", "q_proj,v-proj"], "--lora.target_modules: 'v-proj' is not"),
    (["--lora.rank", "4", "--lora.dropout", "1"], "--lora.dropout"),
    (["--lora.rank", "4", "--lora.serving", "fast"], "--lora.serving"),
    (["--lora.rank", "600", "--lora.serving", "native"], "--lora.rank: vLLM serves ranks up to 512 natively"),
])
def test_bad_lora_flags_are_one_line(argv: list[str], needle: str) -> None:
    with pytest.raises(UsageError) as e:
        parse_config(argv, check_cpu=False)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("flags, needle", [
    (["--lora.target_modules", "q_proj,w_proj"], "--lora.target_modules: the model has no linear module named 'w_proj'"),
    (["--lora.rank", "100"], "--lora.rank: 100 exceeds"),
])
def test_adapter_that_does_not_fit_the_model_stops_before_ray(flags: list[str], needle: str, tmp_path: Path,
                                                              tiny_model_dir: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline_rl.driver import run

    cfg, _ = parse_config(["--model", tiny_model_dir, "--lora.rank", "4", *flags,
                           "--out-dir", str(tmp_path / "out")], check_cpu=False)
    assert run(cfg) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "out").exists()


def test_targets_default_to_the_projections_the_model_has(tiny_model_dir: str) -> None:
    from pipeline_rl.training.lora import check_lora

    assert check_lora(lora_cfg().lora, tiny_model_dir) == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert check_lora(lora_cfg(lora={"target_modules": "v_proj,q_proj"}).lora, tiny_model_dir) == ("v_proj", "q_proj")


def test_pretrained_profile_has_a_lora_learning_rate() -> None:
    from pipeline_rl.profiles import PRETRAINED_DEFAULTS, PRETRAINED_LORA_DEFAULTS

    full, _ = parse_config(["--model", "smollm2-135m-instruct"], check_cpu=False)
    lora, _ = parse_config(["--model", "smollm2-135m-instruct", "--lora.rank", "16"], check_cpu=False)
    given, _ = parse_config(["--model", "smollm2-135m-instruct", "--lora.rank", "16", "--trainer.lr", "3e-5"],
                            check_cpu=False)
    assert full.trainer.lr == PRETRAINED_DEFAULTS["trainer.lr"]
    assert lora.trainer.lr == PRETRAINED_LORA_DEFAULTS["trainer.lr"] != full.trainer.lr
    assert given.trainer.lr == 3e-5


# ------------------------------------------------------------------------------ the trainer

def test_only_the_adapter_trains_and_is_published(make_trainer: Any, tiny_model_dir: str) -> None:
    """The update is the adapter (PEFT's saved names, lora_A [r, in], lora_B [out, r]), B
    starts at 0 (the wrapped model is the base), training moves it, the base never moves,
    and the KL reference is the base (the adapter off): kl 0 at step 1, > 0 later."""
    from transformers import AutoModelForCausalLM

    from pipeline_rl.weight_sync.receive.lora_update import base_weight_name, is_adapter_name

    t = make_trainer(lora_cfg(algorithm={"kl_coef": 0.1}))
    assert t.ref_model is None                                 # no second copy
    first = adapter_of(t)
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    assert len(first) == 2 * 7 * 2 and all(is_adapter_name(n) for n in first)
    for name, arr in first.items():
        w = base[base_weight_name(name)]
        assert arr.shape == ((4, w.shape[1]) if ".lora_A." in name else (w.shape[0], 4))
        assert (".lora_B." not in name) or not arr.any()
    groups = synthetic_groups(2, 4, seed=2)
    np.testing.assert_allclose(flat_logprobs(t, groups), hf_logprobs(base_model(tiny_model_dir), groups), atol=1e-5)
    kls = [t.step(synthetic_groups(4, 4, seed=100 + s, version=s)).metrics.kl_ref for s in range(3)]
    assert kls[0] == pytest.approx(0.0, abs=1e-7) and kls[2] > 0
    after = adapter_of(t)
    assert any(not np.array_equal(after[n], first[n]) for n in first if ".lora_B." in n)
    frozen = {n: p for n, p in t.engine.module.named_parameters() if not p.requires_grad}
    assert len(frozen) == len(base)                          # every base weight, unchanged
    for n, p in frozen.items():
        assert torch.equal(p, base[n.removeprefix("base_model.model.").replace(".base_layer.", ".")]), n


def base_model(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_checkpoint_is_peft_format_resumes_and_merges(make_trainer: Any, tiny_model_dir: str,
                                                      tmp_path: Path) -> None:
    """A LoRA checkpoint: adapter_config.json + adapter_model.safetensors (no full weights, no
    frozen weights in DeepSpeed's state), loading in peft with the trainer's log-probs;
    resuming from it takes the same next step as the uninterrupted trainer; the merged model
    gives the same log-probs as a plain transformers model."""
    import peft

    from pipeline_rl.training.lora import write_merged

    cfg = lora_cfg()
    a = make_trainer(cfg)
    steps(a, 2)
    ckpt = a.save_checkpoint(tmp_path / "step_2")
    files = {p.name for p in ckpt.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "run_state.json"} <= files
    assert "model.safetensors" not in files and "config.json" not in files
    assert sum(f.stat().st_size for f in (ckpt / "deepspeed").rglob("*")) < 20 * (ckpt / "adapter_model.safetensors").stat().st_size
    groups = synthetic_groups(2, 4, seed=5)
    want = flat_logprobs(a, groups)
    loaded = peft.PeftModel.from_pretrained(base_model(tiny_model_dir), str(ckpt)).eval()
    np.testing.assert_allclose(hf_logprobs(loaded, groups), want, atol=1e-5)
    merged = write_merged(ckpt, tmp_path / "merged")
    np.testing.assert_allclose(hf_logprobs(base_model(str(merged)), groups), want, atol=1e-5)

    b = make_trainer(cfg)
    assert b.load_checkpoint(ckpt).version == 2
    assert steps(b, 1, first=2) == pytest.approx(steps(a, 1, first=2), abs=1e-6)
    for name, arr in adapter_of(a).items():
        np.testing.assert_allclose(adapter_of(b)[name], arr, atol=1e-6, err_msg=name)


# ------------------------------------------------------------------------------ ZeRO-3, two ranks

def _rank_main(rank: int, port: int, model_dir: str, out: str) -> None:
    import os

    os.environ.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    from pipeline_rl.training.trainer import Trainer

    cfg = lora_cfg(trainer={"zero_stage": 3, "num_ranks": 2, "micro_batch_size": 4})
    t = Trainer(cfg, model_dir, rank=rank, world_size=2, master_port=port)
    for s in range(3):
        groups = synthetic_groups(4, 4, seed=100 + s, version=s)
        t.step(groups[2 * rank:2 * rank + 2])
    adapter = adapter_of(t)                        # a collective under ZeRO-3
    t.save_checkpoint(Path(out).with_suffix(".ckpt"))
    if rank == 0:
        np.savez(out, **adapter)  # type: ignore[arg-type]


def test_zero3_two_ranks_trains_the_same_adapter(make_trainer: Any, tiny_model_dir: str, tmp_path: Path) -> None:
    """Same groups, 3 steps: ZeRO-3 over two ranks (spawned, gloo) and ZeRO-0 on one rank reach
    the same adapter; the two-rank checkpoint holds it in PEFT's format."""
    from safetensors.numpy import load_file

    t = make_trainer(lora_cfg(trainer={"micro_batch_size": 4}))
    steps(t, 3)
    ref = adapter_of(t)
    ctx = mp.get_context("spawn")
    port, out = rendezvous_port(), tmp_path / "z3.npz"
    procs = [ctx.Process(target=_rank_main, args=(r, port, tiny_model_dir, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0, 0], f"rank exit codes {codes}"
    with np.load(out) as z:
        dp = {k: z[k] for k in z.files}
    assert sorted(dp) == sorted(ref)
    for name, arr in ref.items():
        np.testing.assert_allclose(dp[name], arr, rtol=1e-4, atol=2e-5, err_msg=name)
    saved = load_file(str(tmp_path / "z3.ckpt" / "adapter_model.safetensors"))
    assert sorted(saved) == sorted(ref) and all(np.array_equal(saved[n], dp[n]) for n in saved)


def test_the_startup_line_names_the_serving_mode() -> None:
    from pipeline_rl.driver import startup_line

    cfg, _ = parse_config(["--lora.rank", "8", "--model.device", "cpu"], check_cpu=False)
    assert startup_line(cfg).endswith("| lora: rank 8, alpha 32, targets auto, serving merged (auto on cpu)")
    assert cfg.lora.serving_mode("cuda") == "native"
    forced, _ = parse_config(["--lora.rank", "8", "--lora.serving", "native"], check_cpu=False)
    assert "serving native (forced)" in startup_line(forced)
    assert "lora" not in startup_line(Config())


def test_the_startup_line_says_when_a_ratio_objective_is_reinforce() -> None:
    """One pass against the proximal policy: ratio 1, REINFORCE's gradient; said on the start-up
    line with the two ways out, and not said when either is taken or for reinforce itself."""
    from pipeline_rl.driver import startup_line

    said = "its ratio is 1, its gradient REINFORCE's"
    assert said in startup_line(Config.model_validate({"algorithm": {"loss": "cispo"}}))
    assert said not in startup_line(Config.model_validate({"algorithm": {"loss": "cispo", "ppo_epochs": 2}}))
    assert said not in startup_line(Config.model_validate(
        {"algorithm": {"loss": "gspo", "ratio_reference": "behaviour"}}))
    assert "loss:" not in startup_line(Config())
