"""What the warm start is: :class:`WarmStartRecipe` (its knobs, part of the cache key) and
:func:`recipe_for`, the measured default for each built-in task. Data only: no torch here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WarmStartRecipe:
    """How the built-in model is warm-started (part of the cache key: change it, and the cache rebuilds).

    ``smoothing`` spreads that much of each answer digit's target mass uniformly
    over the ten digits (the ``<eos>`` target stays one-hot). Converged, the
    model ranks the right digit first but samples it with probability about
    ``1 - 0.9 * smoothing``: it knows the format and the skill, yet at
    temperature 1 it gets a whole answer right only about
    ``(1 - 0.9 * smoothing) ** answer_digits`` of the time. That gap between
    what it knows (greedy) and what it samples is what RL closes.

    ``decoy_frac``: that share of the examples teaches a plausible wrong answer
    instead (:func:`~pipeline_rl.models.demonstrations.decoy_answer`: for ``sort``, the digits as given, unsorted).
    With ``decoy_frac > 0.5`` the converged model's *greedy* answer is the decoy
    (right only when the input is already in order) while about
    ``1 - decoy_frac`` of its samples are right: RL has to make the skill the
    model's first choice, and held-out greedy accuracy shows when it has.
    """

    steps: int = 500
    batch_size: int = 64
    lr: float = 1e-3
    smoothing: float = 0.368
    seed: int = 0
    decoy_frac: float = 0.0
    micro_batches: int = 1  # > 1: the batch is sorted by length and run in that many chunks
    version: int = 3  # bump when the training code changes what it produces
    stop_reward: float = 0.0  # > 0: closed loop (warmstart.warm_start), stop once sampled >= this
    chunk: int = 100          # closed loop: steps between checks (learning rate decaying)
    max_chunks: int = 0       # closed loop: chunks at most after ``steps``
    probe_prompts: int = 64   # closed loop: training prompts sampled once each after a chunk
    probe_tokens: int = 16    # closed loop: their token budget

    @property
    def closed_loop(self) -> bool:
        return self.stop_reward > 0.0



def recipe_for(task_name: str, digits: int, *, target_reward: float = 0.25,
               steps: int | None = None, seed: int = 0) -> WarmStartRecipe:
    """The default warm start for a built-in task: a model that knows the answer format, writes
    the right answer in about ``target_reward`` of its samples and the task's decoy
    (:func:`~pipeline_rl.models.demonstrations.decoy_answer`) in the rest -- so its greedy answer is the decoy.

    Measured for ``sort`` with 4 digits (the default; 500 held-out prompts, transformers):
    greedy accuracy 0.18, sampled accuracy 0.28 at temperature 1. (With 30% right answers:
    0.23 and 0.33, too close to the 0.3 a skill-gaining demo should start under; with 500
    steps the right answers are learnt less well and RL ends less sharp.) The default run's RL
    then turns the skill into the model's first choice (README, "What the default run shows").

    ``calc`` (4 digits) takes the same recipe, on whole episodes (:func:`~pipeline_rl.models.demonstrations.demonstration`):
    measured on 256 held-out prompts (transformers episodes), the model calls the tool in
    about 0.21-0.25 of its samples, and its calls and copies are right (sampled episode
    reward 0.24); greedy 0.0 (the decoy). 196 s on one idle core.

    ``countdown`` (answers of 4-492 tokens) is closed-loop: 300 steps at 1e-3, then the rate
    decays linearly over at most 600 steps, checked every 100 on 128 training prompts
    (sampled, 492 tokens), stopping at the first check >= ``0.8 * target_reward`` (0.2).
    The fixed 600-step recipe it replaces (version 3) gave held-out sampled 0.18 here and
    0.0 on another x86 machine (other weights: sha256 bd52a38c... here, 66e6bddf... there).
    Forcing AVX2 kernels here rebuilds that machine's weights bit for bit (66e6bddf..., 272 s):
    its loss spiked in the last steps at the constant 1e-3 (mean of the last 20: 0.24, against
    0.008 with this machine's kernels), and 600 steps ended inside the spike: probe 0.0, 0.0.
    Measured on this AMD EPYC (AVX-512) with its own kernels and with AVX2 forced
    (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``, as on a machine without AVX-512):
    other weights (sha256 03214ecd... and db874635...), both stopped at the first check
    (400 steps; training prompts 0.35 and 0.31), held-out probe sampled 0.17 and 0.18,
    greedy 0.0 (the decoy), every sample stopped with ``<eos>``; 185 s and 180 s on one core.
    """
    if not 0.0 < target_reward < 1.0:
        raise ValueError(f"target_reward must be in (0, 1) (got {target_reward})")
    if task_name == "countdown":
        # Answers of 4-492 tokens: 32 examples a step in 4 length-sorted chunks (a quarter of
        # the padding), at 1e-3; closed loop (see the docstring).
        from pipeline_rl.tasks.builtin import countdown_answer_tokens

        return WarmStartRecipe(steps=steps if steps is not None else 300, batch_size=32, lr=1e-3,
                               smoothing=0.0, decoy_frac=round(1.0 - target_reward, 3), seed=seed,
                               micro_batches=4, version=4, stop_reward=round(0.8 * target_reward, 3),
                               chunk=100, max_chunks=6, probe_prompts=128,
                               probe_tokens=countdown_answer_tokens(digits))
    default_steps = 1000 + 100 * max(0, digits - 4)
    return WarmStartRecipe(steps=steps if steps is not None else default_steps, smoothing=0.0,
                           decoy_frac=round(1.0 - target_reward, 3), seed=seed)
