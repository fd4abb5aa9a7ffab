"""Architecture conformance: Llama, Qwen2, Qwen3, Phi-3 and Mistral through the whole stack.

For each architecture of :data:`benchmarks.archs.ARCHS` (tiny random models built locally by
:func:`benchmarks.archs.build_arch_model`, nothing downloaded), checked:

- the tokenizer: ``AutoTokenizer`` round-trips prompts and answers and gives the ids
  vLLM's tokenizer gives (transformers 5 builds ``Qwen2Tokenizer`` for Qwen folders);
- vLLM's sampled-token log-probs equal transformers' (fp32, within :data:`TOL`) at start;
- five in-flight weight updates through the direct loader (``DirectLoader``), with
  sequences running across all of them (KV policy ``keep``): their per-token versions,
  every token's log-prob against transformers replaying the same mixed-weights KV cache,
  and fresh requests after the fifth update against the fifth weights;
- a checkpoint saved by the real DeepSpeed trainer after two steps loads in transformers
  and in a new vLLM engine with equal log-probs; on that engine (KV policy ``recompute``)
  five in-flight updates, every token against transformers under its version's weights;
- (slow) a 20-step run of ``launch/async_grpo.py`` on the model and a JSONL dataset.

The maximum log-prob differences are printed at the end of the module (``pytest -s``)
and written as JSON to ``$CONFORMANCE_REPORT`` when that variable is set.

At most one vLLM engine lives at a time (each reserves a 1 GiB KV cache): the
:class:`EngineSlot` fixture closes one before starting the next.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.archs import ARCHS, EOS, HF_ARCHITECTURE, IM_START, build_arch_model, write_addition_jsonl
from pipeline_rl.rollout.engines.engine import (
    EngineConfig,
    FinishedSequence,
    GenerationEngine,
    GenRequest,
    SamplingConfig,
)
from pipeline_rl.weight_sync.message import WeightUpdate, check_update
from tiny_run import TINY_RUN_FLAGS, tiny_run_config

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-4                # max abs log-prob difference, fp32
TEMPERATURE = 0.7
PROMPTS = ("3+4=", "sort 5193=", "12+34=", "what is the sum")
NUM_UPDATES = 5
STEPS_BETWEEN = 3         # engine steps before the first update and after each
LONG_TOKENS = 40          # sequences that run across every update
NOISE_STD = 0.02          # per-version perturbation of every parameter (init std 0.08)
LAUNCH_TIMEOUT_S = 420

#: arch -> measurement -> value; printed and saved at the end of the module.
REPORT: dict[str, dict[str, Any]] = {}


# ------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="session")
def arch_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("archs")


@pytest.fixture(scope="module", params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    """The architecture under test (module-scoped, so tests run grouped by architecture)."""
    return str(request.param)


@pytest.fixture(scope="module")
def model_dir(arch: str, arch_root: Path) -> Path:
    """The tiny random model of ``arch`` (seed: its index, so Llama and Mistral differ), built once per session."""
    out = arch_root / arch
    if not (out / "model.safetensors").is_file():
        build_arch_model(arch, out, seed=ARCHS.index(arch))
    return out


@pytest.fixture(scope="session")
def dataset(arch_root: Path) -> Path:
    return write_addition_jsonl(arch_root / "addition.jsonl", rows=200)


class EngineSlot:
    """Holds at most one live :class:`InprocessEngine` (fp32) and reuses it while the same
    folder and KV policy are asked for."""

    def __init__(self) -> None:
        self._engine: GenerationEngine | None = None
        self._key: tuple[str, str] | None = None

    def get(self, model_dir: Path, kv_policy: str, *, at_version: int | None = None) -> GenerationEngine:
        """The engine serving ``model_dir`` under ``kv_policy``; a fresh one when none is
        live for them, or when ``at_version`` is given and the live one has moved on."""
        from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine

        key = (str(model_dir), kv_policy)
        if self._engine is not None and (self._key != key or (at_version is not None
                                                               and self._engine.version != at_version)):
            self.close()
        if self._engine is None:
            self._engine = InprocessEngine(EngineConfig(model_dir=str(model_dir), dtype="float32",
                                                  kv_policy=kv_policy,  # type: ignore[arg-type]
                                                  max_num_seqs=16, max_model_len=128))
            self._key = key
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine, self._key = None, None


@pytest.fixture(scope="session")
def slot() -> Iterator[EngineSlot]:
    s = EngineSlot()
    yield s
    s.close()


def _load_hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _versions_of(base: torch.nn.Module, num_updates: int, seed: int) -> list[torch.nn.Module]:
    """``base`` and ``num_updates`` successors, each the previous plus N(0, NOISE_STD) on
    every parameter (a tied embedding is one parameter, so the LM head moves with it)."""
    gen = torch.Generator().manual_seed(seed)
    models = [base]
    for _ in range(num_updates):
        m = copy.deepcopy(models[-1])
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * NOISE_STD)
        models.append(m.eval())
    return models


@pytest.fixture(scope="module")
def hf_versions(model_dir: Path, arch: str) -> list[torch.nn.Module]:
    """transformers models of versions 0 (the folder) to 5 (perturbed) of ``arch``."""
    base = _load_hf(model_dir)
    assert type(base).__name__ == HF_ARCHITECTURE[arch]
    return _versions_of(base, NUM_UPDATES, seed=1)


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[dict[str, dict[str, Any]]]:
    """Print the collected numbers when the module ends; save them to $CONFORMANCE_REPORT."""
    yield REPORT
    if not REPORT:
        return
    print("\n\narchitecture conformance: max |logp_vllm - logp_hf| (fp32) and run times")
    for arch_name, row in REPORT.items():
        print(f"  {arch_name:8s} " + "  ".join(f"{k}={_fmt(v)}" for k, v in row.items()))
    out = os.environ.get("CONFORMANCE_REPORT")
    if out:
        Path(out).write_text(json.dumps(REPORT, indent=2, sort_keys=True))


def _fmt(v: Any) -> str:
    return f"{v:.2e}" if isinstance(v, float) and v < 0.01 else str(v)


def _record(arch: str, key: str, value: Any) -> None:
    REPORT.setdefault(arch, {})[key] = value
    print(f"[{arch}] {key} = {_fmt(value)}")


# ------------------------------------------------------------------------------ helpers

def _update_of(model: torch.nn.Module, version: int) -> WeightUpdate:
    """The full weights of ``model`` as a :class:`WeightUpdate` (named_parameters names,
    tied weights once: what the trainer publishes)."""
    names, arrays = [], []
    for name, p in model.named_parameters():
        names.append(name)
        arrays.append(np.ascontiguousarray(p.detach().float().numpy().copy()))
    return WeightUpdate(version, tuple(names), tuple(arrays))


def _apply(engine: GenerationEngine, model: torch.nn.Module, version: int) -> None:
    """Stage ``model``'s weights as ``version`` and make them live, as the rollout
    worker does; they must take the direct loader, not vLLM's layerwise reload."""
    assert engine.stage(check_update(_update_of(model, version), engine.weight_spec,
                                     current_version=engine.version))
    assert getattr(engine, "last_staging_path") == "direct"
    applied = engine.apply_staged()
    assert applied is not None and applied.version == version == engine.version


def _requests(engine: GenerationEngine, tag: str, max_new_tokens: int) -> list[GenRequest]:
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=TEMPERATURE, ignore_eos=True)
    return [GenRequest(f"{tag}-{i}", tuple(engine.encode(p)), sampling) for i, p in enumerate(PROMPTS)]


def _step(engine: GenerationEngine, steps: int | None = None) -> dict[str, FinishedSequence]:
    """Step ``steps`` times (None: until nothing is unfinished); the finished sequences."""
    done: dict[str, FinishedSequence] = {}
    n = 0
    while engine.num_unfinished() and (steps is None or n < steps):
        done.update((f.request_id, f) for f in engine.step())
        n += 1
    return done


def _logp_of(logits: torch.Tensor, tokens: torch.Tensor) -> np.ndarray:
    logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    return logp.gather(-1, tokens.long()[:, None])[:, 0].numpy()


@torch.no_grad()
def _hf_logprobs(model: torch.nn.Module, prompt: tuple[int, ...], tokens: np.ndarray) -> np.ndarray:
    """log pi(token_t | prompt, tokens_<t) under ``model`` (one full forward), after temperature."""
    ids = torch.tensor([list(prompt) + tokens.tolist()])
    logits = model(ids).logits[0, len(prompt) - 1:-1]
    return _logp_of(logits, torch.from_numpy(tokens))


@torch.no_grad()
def _hf_recompute_logprobs(models: list[torch.nn.Module], prompt: tuple[int, ...], tokens: np.ndarray,
                           versions: np.ndarray) -> np.ndarray:
    """KV policy ``recompute``: token t scored by a full forward under ``models[versions[t]]``."""
    out = np.empty(len(tokens), dtype=np.float32)
    for v in np.unique(versions):
        at = versions == v
        out[at] = _hf_logprobs(models[int(v)], prompt, tokens)[at]
    return out


@torch.no_grad()
def _hf_keep_logprobs(models: list[torch.nn.Module], prompt: tuple[int, ...], tokens: np.ndarray,
                      versions: np.ndarray) -> np.ndarray:
    """KV policy ``keep``: replay generation one token at a time, each step under the
    weights of the version that sampled the token, on one growing KV cache. So the KV of
    the prompt comes from the first token's weights and the KV of token t from the
    weights that sampled token t+1 -- as in vLLM, where an update changes the weights
    of later forward passes and leaves the KV already written in place."""
    first = models[int(versions[0])](torch.tensor([list(prompt)]), use_cache=True)
    cache = first.past_key_values
    logits = [first.logits[0, -1]]
    for t in range(1, len(tokens)):
        step = models[int(versions[t])](torch.tensor([[int(tokens[t - 1])]]), past_key_values=cache,
                                        use_cache=True)
        cache = step.past_key_values
        logits.append(step.logits[0, -1])
    return _logp_of(torch.stack(logits), torch.from_numpy(tokens))


def _max_diff(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - ref.astype(np.float64)).max())


def _expected_versions(num_tokens: int) -> list[int]:
    """Per-token versions of a sequence started before the first of the updates applied
    every :data:`STEPS_BETWEEN` steps (one token per sequence per step)."""
    out = []
    for v in range(NUM_UPDATES):
        out += [v] * STEPS_BETWEEN
    return out + [NUM_UPDATES] * (num_tokens - len(out))


def _run_across_updates(engine: GenerationEngine, models: list[torch.nn.Module], tag: str
                        ) -> tuple[list[GenRequest], dict[str, FinishedSequence]]:
    """Start long sequences, apply versions 1..5 of ``models`` every STEPS_BETWEEN steps
    while they run; returns the requests and their finished sequences (none may finish
    before the last update)."""
    assert engine.version == 0
    reqs = _requests(engine, tag, LONG_TOKENS)
    for r in reqs:
        engine.add(r)
    assert not _step(engine, STEPS_BETWEEN)
    for v in range(1, NUM_UPDATES + 1):
        assert engine.num_unfinished() == len(reqs)
        _apply(engine, models[v], v)
        assert not _step(engine, STEPS_BETWEEN)
    return reqs, _step(engine)


# ------------------------------------------------------------------------------ tokenizer

def test_tokenizer_round_trips_and_matches_vllm(arch: str, model_dir: Path, dataset: Path,
                                                 slot: EngineSlot) -> None:
    """``AutoTokenizer`` on the folder decodes what it encodes (prompts, answers, both
    joined, a chat-templated prompt), gives exactly the ids of vLLM's tokenizer, adds no
    BOS, and agrees with config.json on eos/pad ids and vocabulary size."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rows = [json.loads(line) for line in dataset.read_text().splitlines()][:50]
    texts = [r["prompt"] for r in rows] + [r["answer"] for r in rows] + \
            [r["prompt"] + r["answer"] for r in rows] + list(PROMPTS) + [" sort 90 = 09\n"]
    chat = tok.apply_chat_template([{"role": "user", "content": "3+4="}], tokenize=False,
                                   add_generation_prompt=True)
    assert isinstance(chat, str) and chat.startswith(IM_START)
    texts.append(chat)
    engine = slot.get(model_dir, "keep")
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text, (type(tok).__name__, text, ids)
        assert engine.encode(text) == ids, (text, engine.encode(text), ids)
    assert tok.encode(chat)[0] == tok.convert_tokens_to_ids(IM_START)  # one id for the special token
    cfg = json.loads((model_dir / "config.json").read_text())
    assert tok.eos_token == tok.pad_token == EOS
    assert cfg["eos_token_id"] == cfg["pad_token_id"] == tok.eos_token_id
    assert len(tok) <= cfg["vocab_size"] and cfg["vocab_size"] % 64 == 0
    _record(arch, "tokenizer_class", type(tok).__name__)


# ------------------------------------------------------------------------------ generation

def test_logprobs_match_transformers_at_start(arch: str, model_dir: Path, slot: EngineSlot,
                                              hf_versions: list[torch.nn.Module]) -> None:
    """Sampled tokens' log-probs (after temperature) equal transformers' on the folder's weights."""
    engine = slot.get(model_dir, "keep", at_version=0)
    reqs = _requests(engine, "start", 16)
    for r in reqs:
        engine.add(r)
    done = _step(engine)
    worst = 0.0
    for r in reqs:
        f = done[r.request_id]
        assert f.token_ids.shape == f.logprobs.shape == (16,) and (f.versions == 0).all()
        worst = max(worst, _max_diff(f.logprobs, _hf_logprobs(hf_versions[0], r.prompt_ids, f.token_ids)))
    _record(arch, "start", worst)
    assert worst < TOL


def test_in_flight_updates_keep_policy(arch: str, model_dir: Path, slot: EngineSlot,
                                       hf_versions: list[torch.nn.Module]) -> None:
    """Five updates (direct loader) while four sequences run across all of them:

    (a) they finish with non-decreasing versions spanning 0..5, one version per
        STEPS_BETWEEN steps;
    (keep) every token's log-prob equals transformers replaying the same mixed cache
        (each forward under the weights live at that step);
    (b) fresh requests started after the fifth update, while the old ones still run,
        equal transformers under the fifth weights.
    """
    from pipeline_rl.weight_sync.receive.loaders import DIRECT_LOAD_ARCHITECTURES

    assert HF_ARCHITECTURE[arch] in DIRECT_LOAD_ARCHITECTURES
    engine = slot.get(model_dir, "keep", at_version=0)
    reqs, done = _run_across_updates(engine, hf_versions, "keep")
    assert set(done) == {r.request_id for r in reqs}
    keep_worst = 0.0
    for r in reqs:
        f = done[r.request_id]
        assert f.finish_reason == "length" and len(f.token_ids) == LONG_TOKENS
        assert (np.diff(f.versions) >= 0).all()
        np.testing.assert_array_equal(f.versions, _expected_versions(LONG_TOKENS))
        assert set(f.versions.tolist()) == set(range(NUM_UPDATES + 1))
        ref = _hf_keep_logprobs(hf_versions, r.prompt_ids, f.token_ids, f.versions)
        keep_worst = max(keep_worst, _max_diff(f.logprobs, ref))
        # the check is sensitive: re-scoring the whole prefix under each token's version
        # (what ``recompute`` would give) differs from what ``keep`` generated
        assert _max_diff(f.logprobs, _hf_recompute_logprobs(hf_versions, r.prompt_ids, f.token_ids,
                                                            f.versions)) > 1e-3
    _record(arch, "keep_spanning_5_updates", keep_worst)

    # (b) new requests on version 5 while a second batch of long ones is still running
    spanning = _requests(engine, "tail", LONG_TOKENS)
    for r in spanning:
        engine.add(r)
    assert not _step(engine, STEPS_BETWEEN)
    fresh = _requests(engine, "fresh", 16)
    for r in fresh:
        engine.add(r)
    done = _step(engine)
    fresh_worst = 0.0
    for r in fresh:
        f = done[r.request_id]
        assert (f.versions == NUM_UPDATES).all()
        fresh_worst = max(fresh_worst, _max_diff(f.logprobs, _hf_logprobs(hf_versions[-1], r.prompt_ids,
                                                                          f.token_ids)))
        # the updates moved the policy well beyond the tolerance
        assert _max_diff(f.logprobs, _hf_logprobs(hf_versions[0], r.prompt_ids, f.token_ids)) > 0.05
    _record(arch, "after_5_updates", fresh_worst)
    assert keep_worst < TOL and fresh_worst < TOL


# ------------------------------------------------------------------------------ checkpoint

@pytest.fixture(scope="module")
def checkpoint(arch: str, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of the real DeepSpeed trainer (ZeRO-0, fp32) after two steps on
    synthetic groups, from the tiny run's configuration."""
    from benchmarks.synthetic import synthetic_groups
    from pipeline_rl.training.trainer import Trainer

    root = tmp_path_factory.mktemp(f"ckpt_{arch}")
    cfg = tiny_run_config(str(model_dir), root / "run", "--trainer.lr", "1e-2")
    trainer = Trainer(cfg, model_dir)
    try:
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        for i in range(2):
            groups = synthetic_groups(cfg.trainer.batch_size // cfg.rollout.n, cfg.rollout.n,
                                      vocab_size=min(vocab, 300), first_token=3, seed=i)
            assert trainer.step(groups).version == i + 1
        return trainer.save_checkpoint(root / "step_000002")
    finally:
        trainer.close()


def test_checkpoint_loads_in_transformers_and_vllm(arch: str, model_dir: Path, checkpoint: Path,
                                                   slot: EngineSlot) -> None:
    """The trainer's checkpoint folder loads in transformers (same class, moved weights,
    same tokenizer ids) and in a new vLLM engine, and both give the same log-probs."""
    from transformers import AutoTokenizer

    hf = _load_hf(checkpoint)
    start = _load_hf(model_dir)
    assert type(hf).__name__ == HF_ARCHITECTURE[arch]
    before = dict(start.named_parameters())
    moved = [n for n, p in hf.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before), f"unchanged after two steps: {set(before) - set(moved)}"
    tok, tok0 = AutoTokenizer.from_pretrained(str(checkpoint)), AutoTokenizer.from_pretrained(str(model_dir))
    assert [tok.encode(p) for p in PROMPTS] == [tok0.encode(p) for p in PROMPTS]

    engine = slot.get(checkpoint, "recompute", at_version=0)
    reqs = _requests(engine, "ckpt", 16)
    for r in reqs:
        engine.add(r)
    done = _step(engine)
    worst = max(_max_diff(done[r.request_id].logprobs, _hf_logprobs(hf, r.prompt_ids, done[r.request_id].token_ids))
                for r in reqs)
    _record(arch, "checkpoint", worst)
    assert worst < TOL


def test_in_flight_updates_recompute_policy(arch: str, checkpoint: Path, slot: EngineSlot) -> None:
    """(c) KV policy ``recompute`` on the checkpoint's engine: five in-flight updates;
    each token of the sequences running across them equals transformers' full forward
    under the weights of the version that sampled it (the sequence is re-prefilled
    after every update)."""
    engine = slot.get(checkpoint, "recompute", at_version=0)
    models = _versions_of(_load_hf(checkpoint), NUM_UPDATES, seed=2)
    reqs, done = _run_across_updates(engine, models, "rec")
    worst = 0.0
    for r in reqs:
        f = done[r.request_id]
        np.testing.assert_array_equal(f.versions, _expected_versions(LONG_TOKENS))
        worst = max(worst, _max_diff(f.logprobs, _hf_recompute_logprobs(models, r.prompt_ids, f.token_ids,
                                                                        f.versions)))
        # the check is sensitive: keeping the old KV would have given other log-probs
        assert _max_diff(f.logprobs, _hf_keep_logprobs(models, r.prompt_ids, f.token_ids, f.versions)) > 1e-3
    _record(arch, "recompute_spanning_5_updates", worst)
    assert worst < TOL


# ------------------------------------------------------------------------------ launcher

def _tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join(text[-lines:])


@pytest.mark.slow
def test_launcher_runs_20_steps(arch: str, model_dir: Path, dataset: Path, tmp_path: Path,
                                slot: EngineSlot) -> None:
    """``launch/async_grpo.py --model DIR --dataset FILE --max-steps 20`` with the tiny-run
    flags exits 0 and writes 20 steps of metrics."""
    from pipeline_rl.metrics import read_metrics

    slot.close()  # the run starts its own engine; free this process's KV cache first
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "launch" / "async_grpo.py"), "--model", str(model_dir),
           "--dataset", str(dataset), "--max-steps", "20", "--out-dir", str(out), *TINY_RUN_FLAGS]
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    t0 = time.perf_counter()
    with stdout.open("w") as so, stderr.open("w") as se:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=so, stderr=se, start_new_session=True)
        try:
            rc = proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            pytest.fail(f"{arch}: the 20-step run did not finish in {LAUNCH_TIMEOUT_S} s; stderr tail:\n"
                        f"{_tail(stderr)}")
    wall = time.perf_counter() - t0
    _record(arch, "launcher_20_steps_s", round(wall, 1))
    assert rc == 0, f"{arch}: async_grpo.py exited {rc}; stderr tail:\n{_tail(stderr)}"
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 21)), f"{arch}: steps {[r['step'] for r in rows]}"
    _record(arch, "launcher_reward_mean_last5", round(float(np.mean([r["reward_mean"] for r in rows[-5:]])), 3))
    _record(arch, "launcher_mixed_version_frac_max", round(max(float(r["mixed_version_frac"]) for r in rows), 3))
    # A quiet console: one line per start-up phase on stderr (the step lines go to stdout, the
    # actors' own output to OUT/logs/), at most 10 before the first step.
    before = [ln for ln in stderr.read_text().splitlines()
              if ln.strip() and not ln.startswith("pipeline_rl.run.checkpoints: ")]   # after the steps
    assert len(before) <= 10, f"{arch}: {len(before)} console lines:\n" + "\n".join(before)
    assert stdout.read_text().startswith("step    1 |"), stdout.read_text()[:500]
    assert {"buffer.log", "rollout-0.log", "trainer-0.log"} <= {f.name for f in (out / "logs").iterdir()}


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the run's process group (it was started in its own session), then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
