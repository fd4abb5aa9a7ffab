"""Supervised warm start of the built-in model on a built-in task, and the probes that size it.

Why: a randomly initialised model never samples a correct answer, so RL would
have no signal in the minutes the CPU default has. The default warm start is
teacher-forced training on a mixture: 25% of the examples show the right
answer, 75% a plausible wrong one (the *decoy*: for ``sort``, the digits
copied as given). The model learns the format (digits, then ``<eos>``) and
both answers; its greedy answer is mostly the decoy (held-out greedy accuracy
about 0.1-0.2: the input already sorted, or a prompt where it trusts the right
answer more) and about 25-30% of its samples are right. RL with the exact-match reward has to make the skill its first choice,
which held-out greedy accuracy shows (measured by the run's own evaluation,
``--eval.every``).

A multi-turn task (``calc``) shows whole episodes (:func:`~pipeline_rl.models.demonstrations.demonstration`): the model's
turns, each ending with ``<eos>``, are trained on; the environment's replies between them
are in the input only, as the rollout worker appends them (loss mask 0).

Another recipe (``smoothing > 0``) spreads part of each answer digit's target
over the ten digits: the model then ranks the right digit first (greedy
accuracy ~1.0) but samples a wholly right answer rarely, a noisy imitator that
RL only sharpens.

Everything is deterministic for a given recipe (seeded torch generator and
prompt sampler): the same recipe, torch build, thread count *and CPU kernels* give
the same weights. Another x86 machine picks other kernels (AVX2 against AVX-512:
other rounding), so a long training drifts to other weights; where that changes what
the model does (``countdown``), the recipe is closed-loop (:func:`warm_start`): it
measures the model as it trains and stops once it samples the right answer often enough.

The recipe is :mod:`~pipeline_rl.models.warmstart_recipe`, the examples and their targets
:mod:`~pipeline_rl.models.demonstrations`, the closed loop's check
:func:`~pipeline_rl.models.probes.sampled_reward`. This module is the training loop only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from pipeline_rl.models.demonstrations import demonstration, soft_targets
from pipeline_rl.models.probes import sampled_reward
from pipeline_rl.tasks.base import Part, Task

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from pipeline_rl.console import Progress
    from pipeline_rl.models.warmstart_recipe import WarmStartRecipe


def warm_start(model: "PreTrainedModel", task: Task, recipe: WarmStartRecipe,
               *, prompt_ids: Sequence[int] | None = None,
               check: Callable[["PreTrainedModel"], float] | None = None,
               checks: list[tuple[int, float]] | None = None,
               progress: "Progress | None" = None) -> list[float]:
    """Teacher-forced training of ``model`` on ``task`` answers (in place); returns the loss curve.

    Prompts are drawn from the task's pool with a seeded generator (or from
    ``prompt_ids`` when given); the loss is the cross-entropy against the
    smoothed targets of :func:`~pipeline_rl.models.demonstrations.soft_targets`, on answer and ``<eos>`` tokens only.

    Closed loop (``recipe.stop_reward > 0``): after ``recipe.steps`` steps at ``recipe.lr``,
    the learning rate falls linearly towards 0 over ``max_chunks`` chunks of ``chunk`` steps
    (one monotone decay: restarting each chunk at the full rate spiked the loss); after
    each chunk ``check(model)`` (default :func:`~pipeline_rl.models.probes.sampled_reward`) measures the model, and
    training stops at the first chunk that scores at least ``stop_reward`` (else after the
    last). ``(steps so far, score)`` of each check is appended to ``checks``.
    ``progress`` (optional) counts the steps, its total reaching to the next check (a
    ``check`` may show its own progress on it meanwhile).
    """
    import random

    import torch

    rng = random.Random(f"warmstart:{recipe.seed}")
    pool = list(prompt_ids) if prompt_ids is not None else None
    vocab = int(model.config.vocab_size)
    losses: list[float] = []
    with torch.random.fork_rng():
        torch.manual_seed(recipe.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
        model.train()

        def step(lr: float) -> None:
            for group in opt.param_groups:
                group["lr"] = lr
            ids_ = [rng.choice(pool) if pool else rng.randrange(task.num_prompts)
                    for _ in range(recipe.batch_size)]
            examples = []
            for i in ids_:
                p = task.prompt(i)
                decoy = recipe.decoy_frac > 0 and rng.random() < recipe.decoy_frac
                examples.append((p.text, demonstration(task, p, decoy)))
            opt.zero_grad()
            losses.append(_accumulate(model, examples, recipe, vocab))
            opt.step()
            if progress is not None:
                progress.update()

        for _ in range(recipe.steps):
            step(recipe.lr)
        if recipe.closed_loop:
            measure = check if check is not None else (lambda m: sampled_reward(m, task, recipe))
            decay = recipe.chunk * recipe.max_chunks
            for c in range(recipe.max_chunks):
                if progress is not None:
                    progress.set_total(len(losses) + recipe.chunk)
                for k in range(c * recipe.chunk, (c + 1) * recipe.chunk):
                    step(recipe.lr * (1.0 - k / decay))
                model.eval()
                score = measure(model)
                model.train()
                if checks is not None:
                    checks.append((len(losses), score))
                if score >= recipe.stop_reward:
                    break
        model.eval()
    return losses


def _accumulate(model: "PreTrainedModel", examples: list[tuple[str, tuple[Part, ...]]],
                recipe: WarmStartRecipe, vocab: int) -> float:
    """Backward of the batch's loss (mean over all its answer tokens) in ``recipe.micro_batches``
    chunks of examples of similar length (sorted by length, so little is padded); returns the loss."""
    import torch

    def length(example: tuple[str, tuple[Part, ...]]) -> int:
        return len(example[0]) + sum(len(text) + by_model for text, by_model in example[1])

    order = sorted(examples, key=length) if recipe.micro_batches > 1 else examples
    size = -(-len(order) // recipe.micro_batches)
    chunks = [order[i:i + size] for i in range(0, len(order), size)]
    built = [soft_targets(chunk, recipe.smoothing, vocab) for chunk in chunks]
    total = sum(float(mask.sum()) for _, _, mask in built)
    loss_sum = 0.0
    for ids, targets, mask in built:
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)   # [b, L, V]
        loss = -((targets * logp).sum(-1) * mask).sum() / total
        loss.backward()
        loss_sum += float(loss.detach())
    return loss_sum

