"""The DeepSpeed trainer's CUDA path (real DeepSpeed, NCCL, one rank, tiny Llama): the model on
the GPU, the loss going down, log-probs matching a CPU float32 reference, ``weights()`` complete
under ZeRO-3, checkpoint save -> load -> resume equal to the uninterrupted run, in bf16 and fp32.

Marked ``gpu``: skipped with a reason where no CUDA device is present (the project's CI). Each
configuration runs in its own spawned process: DeepSpeed picks its accelerator and the process
group its backend once per process, and the CPU tests of the same session hold gloo / CPU.
Nothing here imports DeepSpeed at collection time. Step times are printed (``pytest -s``).
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline_rl.config import Config

NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False)"


def make_cfg(dtype: str, stage: int, device: str, kl_coef: float = 0.0) -> Config:
    """4 groups x 4 completions, two micro-batches; no correction, so the surrogate loss on a
    fixed batch is a consistent objective (as test_trainer's loss test)."""
    return Config.model_validate({
        "model": {"dtype": dtype, "device": device},
        "rollout": {"n": 4, "temperature": 1.0},
        "correction": {"type": "none"},
        "algorithm": {"kl_coef": kl_coef},
        "trainer": {"batch_size": 16, "micro_batch_size": 8, "lr": 1e-2, "zero_stage": stage},
    })


def _max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def scenario(model_dir: str, ckpt_root: str, dtype: str, stage: int, device: str,
             kl_coef: float = 0.0, steps: int = 4) -> dict[str, Any]:
    """Train ``steps`` steps on one batch, compare log-probs with a CPU float32 model holding the
    same weights, checkpoint, take one more step, then resume in a fresh trainer and take the
    same step. Returns plain values (runs in a spawned process)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from benchmarks.synthetic import synthetic_groups
    from pipeline_rl.training.trainer import Trainer

    cfg = make_cfg(dtype, stage, device, kl_coef)
    groups = synthetic_groups(4, 4, seed=0)
    nxt = synthetic_groups(4, 4, seed=1, version=steps)
    t = Trainer(cfg, model_dir)
    from deepspeed.accelerator import get_accelerator

    out: dict[str, Any] = {
        "device": str(t.device), "backend": str(dist.get_backend()),
        "accelerator": get_accelerator().device_name(),
        "param_devices": sorted({p.device.type for p in t.engine.module.parameters()}),
        "param_dtypes": sorted({str(p.dtype) for p in t.engine.module.parameters()}),
    }
    w0 = t.weights()
    results = [t.step(groups) for _ in range(steps)]
    out["losses"] = [r.loss for r in results]
    out["versions"] = [r.version for r in results]
    out["step_times"] = [r.step_time_s for r in results]
    out["grad_norms"] = [r.grad_norm for r in results]
    u = t.weights()
    w = dict(zip(u.names, u.arrays, strict=True))
    out["weights_dtype"] = sorted({str(a.dtype) for a in u.arrays})
    out["moved"] = sum(not np.array_equal(a, b) for a, b in zip(w0.arrays, u.arrays, strict=True))

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shapes = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    out["shapes_match"] = shapes == {n: a.shape for n, a in w.items()}
    ref.load_state_dict({n: torch.from_numpy(a) for n, a in w.items()}, strict=True)
    got = t.logprobs(groups)
    diffs = []
    for g, per_group in zip(groups, got, strict=True):
        for c, lp in zip(g.completions, per_group, strict=True):
            ids = torch.from_numpy(np.concatenate([g.prompt_ids, c.token_ids])).long()[None]
            with torch.no_grad():
                logits = ref(input_ids=ids).logits[0, :-1].float()
            want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            diffs.append(np.abs(lp - want[len(g.prompt_ids) - 1:].numpy()))
    flat = np.concatenate(diffs)
    out["logp_diff_max"], out["logp_diff_mean"] = float(flat.max()), float(flat.mean())

    path = t.save_checkpoint(Path(ckpt_root) / "step")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    out["hf_diff"] = _max_diff({n: p.detach().numpy() for n, p in hf.named_parameters()}, w)
    r_next = t.step(nxt)
    un = t.weights()
    t.close()

    # the driver's way (actors/trainer_actor.py): build from the base model, then load the checkpoint,
    # so the KL reference stays the base model
    t2 = Trainer(cfg, model_dir)
    state = t2.load_checkpoint(path)
    out["resumed"] = (t2.version, state.data_position)
    lu = t2.weights()
    out["load_diff"] = _max_diff(dict(zip(lu.names, lu.arrays, strict=True)), w)
    r2 = t2.step(nxt)
    ru = t2.weights()
    out["resume_loss"] = (r_next.loss, r2.loss)
    out["resume_diff"] = _max_diff(dict(zip(ru.names, ru.arrays, strict=True)),
                                   dict(zip(un.names, un.arrays, strict=True)))
    t2.close()
    on_gpu = t.device.type == "cuda"
    out["max_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20 if on_gpu else 0.0
    return out


def run_isolated(*args: Any) -> dict[str, Any]:
    """:func:`scenario` in a fresh spawned process (its own accelerator and process group)."""
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(scenario, *args).result(timeout=300)


CASES = [  # (dtype, zero stage, model.device, kl_coef)
    ("float32", 0, "auto", 0.0),
    ("float32", 3, "cuda", 0.05),     # also the reference model on the GPU
    ("bfloat16", 0, "cuda", 0.0),
    ("bfloat16", 3, "cuda", 0.0),
]


@pytest.mark.parametrize(("dtype", "stage", "device", "kl_coef"), CASES,
                         ids=[f"{d}-zero{s}" for d, s, _, _ in CASES])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_trainer_on_cuda(dtype: str, stage: int, device: str, kl_coef: float, tiny_model_dir: str,
                         tmp_path: Path) -> None:
    r = run_isolated(tiny_model_dir, str(tmp_path), dtype, stage, device, kl_coef)
    times = r["step_times"]
    print(f"\n[cuda {dtype} zero{stage}] step_s={['%.4f' % x for x in times]} "
          f"median_after_first={np.median(times[1:]):.4f} losses={['%.4f' % x for x in r['losses']]} "
          f"logp_diff max={r['logp_diff_max']:.2e} mean={r['logp_diff_mean']:.2e} "
          f"resume_loss={r['resume_loss']} resume_diff={r['resume_diff']:.2e} "
          f"grad_norms={r['grad_norms']} max_mem_mib={r['max_memory_mib']:.1f}")
    # placement: DeepSpeed's CUDA accelerator and NCCL although the suite sets DS_ACCELERATOR=cpu
    assert r["device"] == "cuda:0" and r["backend"] == "nccl" and r["accelerator"] == "cuda"
    assert r["param_devices"] == ["cuda"]
    assert r["param_dtypes"] == [{"float32": "torch.float32", "bfloat16": "torch.bfloat16"}[dtype]]
    # training
    assert r["versions"] == [1, 2, 3, 4]
    assert all(np.isfinite(r["losses"])) and r["losses"][-1] < r["losses"][0] - 0.05, r["losses"]
    assert all(g is not None and np.isfinite(g) and g > 0 for g in r["grad_norms"]), r["grad_norms"]
    # weights(): complete float32 copies (ZeRO-3 gathered), all moved
    assert r["shapes_match"] and r["weights_dtype"] == ["float32"] and r["moved"] > 0
    # the GPU's log-probs == a CPU float32 model holding the published weights
    tol = 1e-3 if dtype == "float32" else 0.15
    assert r["logp_diff_max"] < tol, r["logp_diff_max"]
    # checkpoint: HF folder == published weights; resume == uninterrupted
    assert r["hf_diff"] == 0.0 and r["load_diff"] == 0.0
    assert r["resumed"] == (4, 16)
    a, b = r["resume_loss"]
    assert abs(a - b) <= 1e-5 * max(1.0, abs(a)) if dtype == "float32" else abs(a - b) <= 1e-2, (a, b)
    assert r["resume_diff"] <= (1e-5 if dtype == "float32" else 1e-2), r["resume_diff"]


def test_cuda_requested_without_cuda_is_a_clear_error(tiny_model_dir: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """model.device: cuda on a machine without CUDA fails at once, before DeepSpeed starts.
    CUDA is hidden from torch here, so the check runs on GPU machines too."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from pipeline_rl.training.trainer import Trainer

    with pytest.raises(RuntimeError, match="cuda requested but no CUDA device"):
        Trainer(make_cfg("float32", 0, "cuda"), tiny_model_dir)
