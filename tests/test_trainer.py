"""The DeepSpeed trainer on CPU (real DeepSpeed, gloo, tiny Llama): batch layout, log-probs at
temperature, micro-batching == full batch, the loss going down, ZeRO-0 (1 rank) == ZeRO-2
(2 ranks), the continuous-consumption loop over a real ReplayBuffer."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.synthetic import synthetic_groups
from pipeline_rl.training.batching import build_micro_batches, build_shared_prompt_batches, lag_stats
from pipeline_rl.config import Config
from pipeline_rl.net import rendezvous_port


def make_cfg(**trainer: Any) -> Config:
    """Small batches: 4 groups x 4 completions."""
    return Config.model_validate({
        "rollout": {"n": 4, "temperature": 1.0},
        "correction": {"type": "none"},
        "trainer": {"batch_size": 16, "micro_batch_size": 16, "lr": 1e-2, **trainer},
    })


def params_of(trainer: Any) -> dict[str, np.ndarray]:
    u = trainer.weights()
    return dict(zip(u.names, u.arrays, strict=True))


# ------------------------------------------------------------------------------ batch layout

def test_micro_batches_align_completion_tokens_with_targets() -> None:
    groups = synthetic_groups(3, 4, prompt_len=5, max_completion_len=7, seed=3)
    adv = [np.arange(4, dtype=np.float32) + 10 * g for g in range(3)]
    mbs = build_micro_batches(groups, adv, micro_batch_size=5, pad_id=0)
    assert [mb.num_seqs for mb in mbs] == [5, 5, 2]
    flat = [(g, c) for g in groups for c in g.completions]
    seen = set()
    for mb in mbs:
        lengths = (mb.input_ids != 0).sum(1)
        assert mb.input_ids.shape[1] == int(lengths.max())           # padded to its own longest
        for row, idx in enumerate(mb.index.tolist()):
            g, c = flat[idx]
            m = mb.mask[row] > 0
            assert torch.equal(mb.input_ids[row, 1:][m], torch.from_numpy(c.token_ids).long())
            assert torch.allclose(mb.behav_logp[row][m], torch.from_numpy(c.logprobs))
            assert mb.behav_logp[row][~m].abs().sum() == 0
            assert torch.equal(mb.input_ids[row, :5], torch.from_numpy(g.prompt_ids).long())
            assert mb.advantages[row] == adv[groups.index(g)][list(g.completions).index(c)]
            seen.add(idx)
    assert seen == set(range(12))
    # length-sorted: micro-batch lengths never increase
    assert [mb.input_ids.shape[1] for mb in mbs] == sorted((mb.input_ids.shape[1] for mb in mbs), reverse=True)


def test_token_budget_gives_long_rows_narrow_micro_batches() -> None:
    """Heavy-tailed lengths: each micro-batch's padded size stays within the budget (a row
    longer than the budget alone), every row is placed once, and less is padded than with
    rows-only chunking."""
    groups = synthetic_groups(4, 8, prompt_len=5, max_completion_len=120, seed=4)
    adv = [np.zeros(8, dtype=np.float32)] * 4
    whole = build_micro_batches(groups, adv, micro_batch_size=32)
    mbs = build_micro_batches(groups, adv, micro_batch_size=32, max_tokens=400)
    assert len(whole) == 1 and len(mbs) > 1
    assert all(mb.input_ids.numel() <= 400 or mb.num_seqs == 1 for mb in mbs)
    assert sorted(i for mb in mbs for i in mb.index.tolist()) == list(range(32))
    assert sum(mb.input_ids.numel() for mb in mbs) < whole[0].input_ids.numel()
    assert [mb.num_seqs for mb in build_micro_batches(groups, adv, micro_batch_size=32, max_tokens=1)] == [1] * 32
    with pytest.raises(ValueError, match="max_tokens"):
        build_micro_batches(groups, adv, micro_batch_size=4, max_tokens=-1)


def test_lag_stats_counts_per_completion() -> None:
    groups = synthetic_groups(4, 4, version=5, version_spread=2, seed=1)
    s = lag_stats(groups, trainer_version=6)
    lags = [6 - int(c.versions.min()) for g in groups for c in g.completions]
    assert s.max == max(lags) and abs(s.mean - np.mean(lags)) < 1e-9
    assert sum(s.hist) == 16 and s.hist[s.max] > 0
    assert 0.0 < s.mixed_version_frac < 1.0


def test_build_micro_batches_rejects_bad_input() -> None:
    groups = synthetic_groups(2, 4)
    with pytest.raises(ValueError, match="advantages for"):
        build_micro_batches(groups, [np.zeros(3), np.zeros(4)], micro_batch_size=4)
    with pytest.raises(ValueError, match="micro_batch_size"):
        build_micro_batches(groups, [np.zeros(4)] * 2, micro_batch_size=0)


# ------------------------------------------------------------------------------ single rank

@pytest.fixture(scope="module")
def trainer_factory(tiny_model_dir: str) -> Any:
    from pipeline_rl.training.trainer import Trainer

    made: list[Any] = []

    def make(cfg: Config, model_dir: str | None = None) -> Any:
        t = Trainer(cfg, model_dir or tiny_model_dir)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def test_logprobs_are_at_sampling_temperature(trainer_factory: Any, tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    cfg = make_cfg()
    cfg.rollout.temperature = 0.7
    trainer = trainer_factory(cfg)
    groups = synthetic_groups(2, 4, seed=2)
    got = trainer.logprobs(groups)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for g, per_group in zip(groups, got, strict=True):
        for c, lp in zip(g.completions, per_group, strict=True):
            ids = torch.from_numpy(np.concatenate([g.prompt_ids, c.token_ids])).long()[None]
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, :-1] / 0.7
            ref = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            p = len(g.prompt_ids)
            np.testing.assert_allclose(lp, ref[p - 1:].numpy(), atol=1e-5)


def test_loss_goes_down_on_a_fixed_batch(trainer_factory: Any) -> None:
    trainer = trainer_factory(make_cfg(micro_batch_size=6))      # 3 micro-batches of <= 6
    groups = synthetic_groups(4, 4, seed=0)
    results = [trainer.step(groups) for _ in range(6)]
    losses = [r.loss for r in results]
    assert [r.version for r in results] == [1, 2, 3, 4, 5, 6]
    assert losses[-1] < losses[0] - 0.05, losses
    r = results[-1]
    assert r.num_micro_batches == 3 and r.num_seqs == 16 and r.num_groups == 4
    assert r.num_tokens == sum(c.num_tokens for g in groups for c in g.completions)
    assert r.grad_norm is not None and r.grad_norm > 0 and r.step_time_s > 0


def test_micro_batching_equals_full_batch(trainer_factory: Any) -> None:
    groups = synthetic_groups(4, 4, seed=7)
    after = []
    for micro, tokens in ((16, 0), (3, 0), (16, 40)):
        cfg = make_cfg(micro_batch_size=micro, micro_batch_tokens=tokens)
        cfg.correction.type = "tis"
        t = trainer_factory(cfg)
        r = t.step(groups)
        after.append((r.loss, r.grad_norm, params_of(t)))
    # Adam's first step is nearly scale-invariant, so the loss and the pre-clip gradient norm
    # are what catch a wrong normaliser; parameters agree up to float noise amplified by Adam.
    for other in after[1:]:
        assert abs(after[0][0] - other[0]) < 1e-6
        assert after[0][1] == pytest.approx(other[1], rel=1e-5)
        for name, full in after[0][2].items():
            np.testing.assert_allclose(other[2][name], full, atol=1e-4, err_msg=name)


def _mixed_prompt_groups() -> list[Any]:
    """4 groups x 4 completions, prompts of 3, 9, 5 and 12 tokens (distinct group ids)."""
    return [g for i, p in enumerate((3, 9, 5, 12))
            for g in synthetic_groups(1, 4, prompt_len=p, max_completion_len=7, seed=30 + i, first_group_id=i)]


def test_shared_prompt_batches_hold_each_prompt_once() -> None:
    groups = _mixed_prompt_groups()
    adv = [np.arange(4, dtype=np.float32) + 10 * i for i in range(4)]
    padded = build_micro_batches(groups, adv, micro_batch_size=6)
    shared = build_shared_prompt_batches(groups, adv, micro_batch_size=6)
    assert len(shared) == len(padded) == 3
    assert sum(s.num_slots for s in shared) < sum(p.num_slots for p in padded)
    # every row once; rows sorted by completion length (the shared layout's pass width)
    assert sorted(i for s in shared for i in s.index.tolist()) == list(range(16))
    flat = [(g, c) for g in groups for c in g.completions]
    widths = [flat[i][1].num_tokens for s in shared for i in s.index.tolist()]
    assert widths == sorted(widths, reverse=True)
    for s in shared:
        assert s.prompt_ids.shape[0] == len(set(s.row_prompt.tolist()))    # each prompt once
        np.testing.assert_array_equal(s.advantages.numpy(), [adv[flat[i][0].group_id][flat[i][0].completions.index(
            flat[i][1])] for i in s.index.tolist()])
        for row, idx in enumerate(s.index.tolist()):
            g, c = flat[idx]
            k = int(s.row_prompt[row])
            n_p, t = int(s.prompt_lens[k]), c.num_tokens
            np.testing.assert_array_equal(s.prompt_ids[k, :n_p].numpy(), g.prompt_ids)
            np.testing.assert_array_equal(s.completion_ids[row, :t].numpy(), c.token_ids)
            np.testing.assert_array_equal(s.behav_logp[row, :t].numpy(), c.logprobs)
            assert s.mask[row].sum() == t == s.mask[row, :t].sum()
    distinct = sum(len(set(s.row_prompt.tolist())) for s in shared)
    assert sum(s.num_real_tokens for s in shared) == (
        sum(c.num_tokens for _, c in flat) + sum(int(s.prompt_lens.sum()) for s in shared)) and distinct >= 4


def test_shared_prompts_equal_padded_rows(trainer_factory: Any) -> None:
    """Same batch (prompts of 3-12 tokens, split over micro-batches), shared prompts against
    padded rows: the same log-probs, loss, gradient norm and step."""
    groups = _mixed_prompt_groups()
    out = []
    for share in (True, False):
        cfg = make_cfg(micro_batch_size=6, share_prompts=share)
        cfg.correction.type = "tis"
        t = trainer_factory(cfg)
        assert t.share_prompts is share
        logprobs = t.logprobs(groups)
        out.append((logprobs, t.step(groups), params_of(t)))
    (lp_s, r_s, p_s), (lp_p, r_p, p_p) = out
    for a, b in zip(lp_s, lp_p, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5)
    assert r_s.loss == pytest.approx(r_p.loss, abs=1e-6)
    assert r_s.grad_norm == pytest.approx(r_p.grad_norm, rel=1e-5)
    assert r_s.num_tokens == r_p.num_tokens and r_s.num_micro_batches == r_p.num_micro_batches
    assert 0.0 <= r_s.pad_frac < 1.0       # of fewer slots (the layout test counts them)
    for name, a in p_p.items():   # Adam amplifies float noise on near-zero gradients: 1% of lr
        np.testing.assert_allclose(p_s[name], a, atol=1e-4, err_msg=name)


def _one_long_per_group() -> list[Any]:
    """4 groups x 4 completions: one of 15 tokens and three of 2 in each, prompts of 6-12."""
    from pipeline_rl.samples import Completion, Group

    rng = np.random.default_rng(7)
    groups = []
    for g, p in enumerate((6, 9, 12, 7)):
        comps = []
        for c in range(4):
            t = 15 if c == 0 else 2
            comps.append(Completion(rng.integers(3, 120, t, dtype=np.int32), -rng.uniform(0.1, 3, t).astype(np.float32),
                                    np.zeros(t, np.int32), float(c % 2), "stop"))
        groups.append(Group(g, g, 0, rng.integers(3, 120, p, dtype=np.int32), tuple(comps)))
    return groups


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_a_blocks_prompts_run_once_for_its_micro_batches(trainer_factory: Any, entropy_coef: float) -> None:
    """A block whose completions are cut in two (4 long rows, 12 short; a pass costs 8 slots)
    runs its prompts once: both micro-batches continue from one prompt pass, and the step
    (loss, gradient norm, weights) equals the padded layout's, where each row runs alone."""
    groups = _one_long_per_group()
    adv = [np.arange(4, dtype=np.float32) - 1.5 for _ in groups]
    mbs = build_shared_prompt_batches(groups, adv, micro_batch_size=16, pass_tokens=8)
    assert [(mb.block, mb.runs_prompts, mb.num_seqs) for mb in mbs] == [(0, True, 4), (0, False, 12)]
    assert torch.equal(mbs[0].prompt_ids, mbs[1].prompt_ids)
    assert sum(mb.num_real_tokens for mb in mbs) == 6 + 9 + 12 + 7 + 4 * 15 + 12 * 2
    out = []
    for share in (True, False):
        cfg = make_cfg(share_prompts=share, pass_cost_tokens=8)
        cfg.algorithm.entropy_coef = entropy_coef
        t = trainer_factory(cfg)
        out.append((t.step(groups), params_of(t)))
    (r_s, p_s), (r_p, p_p) = out
    assert r_s.num_micro_batches == 2
    assert r_s.loss == pytest.approx(r_p.loss, abs=1e-6)
    assert r_s.grad_norm == pytest.approx(r_p.grad_norm, rel=1e-5)
    for name, a in p_p.items():
        np.testing.assert_allclose(p_s[name], a, atol=1e-4, err_msg=name)


def test_prompt_sharing_falls_back_to_padded_rows(trainer_factory: Any, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A model the shared-prompt continuation does not fit trains on padded rows, said in one
    warning line."""
    import pipeline_rl.training.trainer as trainer_mod

    def unsupported(*_: Any) -> torch.Tensor:
        raise TypeError("cache layers ['DynamicSlidingWindowLayer'] are not plain key/value layers")

    monkeypatch.setattr(trainer_mod, "shared_prompt_logp", unsupported)
    with caplog.at_level("WARNING", logger="pipeline_rl.training.trainer"):
        t = trainer_factory(make_cfg())
    assert not t.share_prompts
    assert any("prompts not shared (padded rows instead): TypeError" in r.getMessage() for r in caplog.records)
    assert t.step(synthetic_groups(4, 4, seed=3)).num_seqs == 16


# ------------------------------------------------------------------------------ two ranks

def _three_steps(trainer: Any, rank: int, world: int) -> dict[str, np.ndarray]:
    """3 steps, each rank on its share of the same groups; losses, grad norms, final params."""
    losses, norms = [], []
    for step in range(3):
        groups = synthetic_groups(4, 4, seed=100 + step, version=step)
        share = len(groups) // world
        r = trainer.step(groups[rank * share:(rank + 1) * share])
        losses.append(r.loss)
        norms.append(r.grad_norm)
    update = trainer.weights()
    return {"losses": np.asarray(losses), "grad_norms": np.asarray(norms, dtype=np.float64),
            **dict(zip(update.names, update.arrays, strict=True))}


def _dp_cfg(stage: int, world: int) -> Config:
    """REINFORCE++-baseline: its whitening is over the whole batch, every rank's share (a
    rank that whitened its own share took a step 54% off in loss)."""
    cfg = make_cfg(zero_stage=stage, num_ranks=world, micro_batch_size=4)
    cfg.correction.type = "tis"
    cfg.algorithm.advantage = "reinforce++-baseline"
    return cfg


def _rank_main(rank: int, world: int, port: int, stage: int, model_dir: str, out: str) -> None:
    """Child process: one rank of a ``world``-rank run."""
    import os

    os.environ.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    from pipeline_rl.training.trainer import Trainer

    trainer = Trainer(_dp_cfg(stage, world), model_dir, rank=rank, world_size=world, master_port=port)
    result = _three_steps(trainer, rank, world)
    trainer.save_checkpoint(Path(out).with_suffix(".ckpt"))   # a collective
    if rank == 0:
        np.savez(out, **result)  # type: ignore[arg-type]


def _run_ranks(world: int, stage: int, model_dir: str, out: Path) -> dict[str, np.ndarray]:
    ctx = mp.get_context("spawn")
    port = rendezvous_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, stage, model_dir, str(out)))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * world, f"rank exit codes {codes}"
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


def test_zero0_one_rank_equals_zero2_two_ranks(tmp_path: Path, tiny_model_dir: str,
                                               trainer_factory: Any) -> None:
    """Same groups, same 3 steps: ZeRO-0 on one rank (here) and ZeRO-2 data-parallel over two
    ranks (two spawned processes, gloo; each rank half of the groups) reach the same parameters,
    advantages whitened over the whole batch included."""
    ref = _three_steps(trainer_factory(_dp_cfg(0, 1)), 0, 1)
    dp = _run_ranks(2, 2, tiny_model_dir, tmp_path / "z2.npz")
    from safetensors.numpy import load_file

    from pipeline_rl.training.checkpoint import read_run_state

    state = read_run_state(tmp_path / "z2.ckpt")                 # saved by both ranks together
    assert (state.version, state.world_size, state.zero_stage, state.data_position) == (3, 2, 2, 12)
    saved = load_file(str(tmp_path / "z2.ckpt" / "model.safetensors"))
    assert all(np.array_equal(saved[n], dp[n]) for n in saved)
    np.testing.assert_allclose(dp["losses"], ref["losses"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dp["grad_norms"], ref["grad_norms"], rtol=1e-4)
    names = [k for k in ref if k not in ("losses", "grad_norms")]
    assert names
    for name in names:   # Adam amplifies float noise on near-zero gradients: 1% of lr
        np.testing.assert_allclose(dp[name], ref[name], rtol=1e-4, atol=1e-4, err_msg=name)
    init = {n: a for n, a in zip(*_initial(tiny_model_dir), strict=True)}
    assert any(not np.allclose(ref[n], init[n]) for n in names)       # training did move them


def _initial(model_dir: str) -> tuple[list[str], list[np.ndarray]]:
    from safetensors.numpy import load_file

    state = load_file(str(Path(model_dir) / "model.safetensors"))
    return list(state), list(state.values())


# ------------------------------------------------------------------------------ the loop

def test_rank_step_consumes_from_replay_buffer(trainer_factory: Any) -> None:
    """The pipeline's per-rank step (the same code the trainer actors run) against a real
    ReplayBuffer fed by a slow producer: it waits (idle is measured), trains, publishes
    every version in order and opens the buffer's admission for the next version."""
    import threading
    import time

    from pipeline_rl.weight_sync.publish.publisher import WeightPublisher
    from pipeline_rl.training.rank_step import RankStep
    from pipeline_rl.buffer.replay import ReplayBuffer

    cfg = make_cfg(micro_batch_size=8)
    trainer = trainer_factory(cfg)
    buf = ReplayBuffer(capacity_groups=16, staleness=1, groups_per_step=4)
    seen: list[int] = []

    class Sink:
        def receive_update(self, update_info: dict[str, Any], weight_version: str) -> float:
            from pipeline_rl.weight_sync.channels.object_store import update_of

            seen.append(update_of(update_info).version)
            return 0.0

    stop = threading.Event()

    def produce() -> None:
        gid = 0
        while not stop.is_set():
            time.sleep(0.05)                              # a slow generator: the trainer waits
            for g in synthetic_groups(2, 4, seed=gid, version=buf.version, first_group_id=gid):
                if not buf.put(g, timeout_s=0.5):
                    return
            gid += 2

    th = threading.Thread(target=produce, daemon=True)
    th.start()
    pub = WeightPublisher([Sink()], background=False, path="object_store")
    step = RankStep(trainer, buf, pub)
    reports = [step(30.0) for _ in range(3)]
    pub.close()
    stop.set()
    buf.close()
    th.join(5)
    assert all(r is not None for r in reports)
    done = [r for r in reports if r is not None]
    assert [r.result.version for r in done] == [1, 2, 3] and buf.version == 3
    assert sum(r.wait_s for r in done) > 0 and all(r.wait_s < r.wall_s for r in done)
    assert seen == [1, 2, 3]
    assert max(r.result.lag.max for r in done) <= 1
    assert step(0.2) is None                              # the buffer is closed: no batch, no step


def test_ppo_epochs_and_kl_penalty(trainer_factory: Any) -> None:
    """PPO with 2 epochs takes 2 optimizer steps per batch but one version (the version counts
    batches: max_steps, checkpoints, lag and admission all use it); the KL penalty to the
    frozen reference is 0 before the first update (policy == reference)."""
    cfg = make_cfg(micro_batch_size=8)
    cfg.algorithm.loss = "ppo"
    cfg.algorithm.ppo_epochs = 2
    cfg.algorithm.kl_coef = 0.1
    trainer = trainer_factory(cfg)
    r = trainer.step(synthetic_groups(4, 4, seed=5))
    assert r.version == 1 and np.isfinite(r.loss)
    assert abs(r.metrics.kl_ref) < 1e-6
    r2 = trainer.step(synthetic_groups(4, 4, seed=6))
    assert r2.version == 2 and r2.metrics.kl_ref > 0


def test_bfloat16_trainer_steps(trainer_factory: Any) -> None:
    cfg = make_cfg(micro_batch_size=8)
    cfg.model.dtype = "bfloat16"
    trainer = trainer_factory(cfg)
    results = [trainer.step(synthetic_groups(4, 4, seed=0)) for _ in range(3)]
    assert all(np.isfinite(r.loss) for r in results) and results[-1].version == 3
    assert all(a.dtype == np.float32 for a in trainer.weights().arrays)


def test_zero3_gathers_full_weights_and_matches_zero0(trainer_factory: Any, tiny_model_dir: str) -> None:
    """Under ZeRO-3 the parameters are partitioned; weights() gathers them in full (HF names and
    shapes) and training matches ZeRO-0."""
    from pipeline_rl.weight_sync.message import read_weight_spec

    out = []
    for stage in (0, 3):
        # padded rows at both stages (ZeRO-3 never shares prompts): the same arithmetic
        trainer = trainer_factory(make_cfg(zero_stage=stage, micro_batch_size=8, share_prompts=False))
        assert not trainer.share_prompts
        for i in range(2):
            trainer.step(synthetic_groups(4, 4, seed=20 + i))
        out.append(params_of(trainer))
    spec = read_weight_spec(tiny_model_dir)
    assert {n: a.shape for n, a in out[1].items()} == spec.shapes
    for name, a in out[0].items():   # Adam amplifies float noise on near-zero gradients: 1% of lr
        np.testing.assert_allclose(out[1][name], a, atol=1e-4, err_msg=name)


def test_pass_cost_gives_a_few_long_rows_a_pass_of_their_own_and_keeps_similar_rows_together() -> None:
    """One 16-token completion among 31 of 5: a narrow pass for it saves more padding than a
    pass costs; lengths within a few tokens stay in one pass; the cut is the cheapest one."""
    from pipeline_rl.samples import Completion, Group

    def batch(long_len: int) -> list[Group]:
        comps = [Completion(np.full(long_len if i == 0 else 5, 7, np.int32), np.zeros(long_len if i == 0 else 5, np.float32),
                            np.zeros(long_len if i == 0 else 5, np.int32), 0.0, "stop") for i in range(32)]
        return [Group(g, g, 0, np.full(10, 3, np.int32), tuple(comps[8 * g:8 * g + 8])) for g in range(4)]

    adv = [np.zeros(8, dtype=np.float32)] * 4
    split = build_micro_batches(batch(16), adv, micro_batch_size=32, max_tokens=4096, pass_tokens=96)
    assert [mb.num_seqs for mb in split] == [1, 31]
    assert sum(mb.input_ids.numel() for mb in split) == 26 + 31 * 15
    shared = build_shared_prompt_batches(batch(16), adv, micro_batch_size=32, max_tokens=4096, pass_tokens=96)
    assert [mb.num_seqs for mb in shared] == [1, 31]
    assert [mb.num_seqs for mb in build_micro_batches(batch(7), adv, micro_batch_size=32, pass_tokens=96)] == [32]
    assert [mb.num_seqs for mb in build_micro_batches(batch(16), adv, micro_batch_size=32)] == [32]
    assert [mb.num_seqs for mb in build_micro_batches(batch(16), adv, micro_batch_size=8, pass_tokens=96)] == [8] * 4
    with pytest.raises(ValueError, match="pass_tokens"):
        build_micro_batches(batch(5), adv, micro_batch_size=4, pass_tokens=-1)
