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

A multi-turn task (``calc``) shows whole episodes (:func:`demonstration`): the model's
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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from pipeline_rl.models.tiny_llama import EOS, PAD, char_vocab
from pipeline_rl.tasks.base import Part, Prompt, Task, task_method

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from pipeline_rl.console import Progress

_VOCAB = char_vocab()
PAD_ID, EOS_ID = _VOCAB[PAD], _VOCAB[EOS]
_CHARS = {i: c for c, i in _VOCAB.items()}


def encode(text: str) -> list[int]:
    """Character ids of ``text`` (same ids as the built-in tokenizer's ``encode``)."""
    return [_VOCAB[c] for c in text]


def decode(ids: Sequence[int]) -> str:
    """Text of ``ids`` up to the first ``<eos>``; other special tokens are dropped."""
    out = []
    for i in ids:
        if i == EOS_ID:
            break
        ch = _CHARS.get(int(i), "")
        out.append(ch if len(ch) == 1 else "")
    return "".join(out)


@dataclass(frozen=True)
class Rollouts:
    """Sampled completions of a batch of prompts (``B`` = prompts x samples per prompt).

    ``tokens[b, t]`` is the t-th completion token (``PAD_ID`` after the sequence
    ended), ``mask[b, t]`` is 1 on generated tokens including the ``<eos>``,
    ``texts[b]`` the decoded answers, ``rewards[b]`` in [0, 1], ``stopped[b]``
    whether the sequence ended with ``<eos>`` (finish reason ``stop``).
    """

    prompt_ids: list[list[int]]
    tokens: "torch.Tensor"   # [B, T] int64
    mask: "torch.Tensor"     # [B, T] float32
    texts: list[str]
    rewards: "torch.Tensor"  # [B] float32
    stopped: "torch.Tensor"  # [B] bool


def _left_pad(seqs: list[list[int]]) -> tuple["torch.Tensor", "torch.Tensor"]:
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        att[i, width - len(s):] = 1
    return ids, att


def sample(model: "PreTrainedModel", task: Task, prompts: Sequence[Prompt], *, n: int,
           max_new_tokens: int, temperature: float, generator: "torch.Generator") -> Rollouts:
    """Sample ``n`` completions per prompt (plain ancestral sampling, no top-p/top-k) and score them."""
    import torch

    prompt_ids = [encode(p.text) for p in prompts for _ in range(n)]
    out, stopped = generate(model, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                            generator=generator)
    batch = out.shape[0]
    mask = torch.zeros(batch, max_new_tokens)
    for b in range(batch):
        row = out[b].tolist()
        length = row.index(EOS_ID) + 1 if EOS_ID in row else max_new_tokens
        mask[b, :length] = 1.0
    texts = [decode(out[b].tolist()) for b in range(batch)]  # as vLLM's skip_special_tokens text
    metas = [p for p in prompts for _ in range(n)]
    rewards = torch.tensor([task.reward(m.text, txt, m) for m, txt in zip(metas, texts)])
    return Rollouts(prompt_ids, out, mask, texts, rewards, stopped)


def generate(model: "PreTrainedModel", prompt_ids: list[list[int]], *, max_new_tokens: int,
             temperature: float, generator: "torch.Generator") -> tuple["torch.Tensor", "torch.Tensor"]:
    """Sampled continuations ``[B, max_new_tokens]`` of token-id prompts (``PAD_ID`` after a
    row's ``<eos>``) and whether each row stopped with ``<eos>`` ``[B]``."""
    import torch

    ids, att = _left_pad(prompt_ids)                       # [B, P]
    batch = ids.shape[0]
    out = torch.full((batch, max_new_tokens), PAD_ID, dtype=torch.long)
    done = torch.zeros(batch, dtype=torch.bool)
    stopped = torch.zeros(batch, dtype=torch.bool)
    with torch.no_grad():
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        res = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True)
        past, logits = res.past_key_values, res.logits[:, -1]
        for t in range(max_new_tokens):
            probs = torch.softmax(logits.float() / temperature, dim=-1)   # [B, V]
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            nxt = torch.where(done, torch.full_like(nxt, PAD_ID), nxt)
            out[:, t] = nxt
            stopped |= (~done) & (nxt == EOS_ID)
            done |= nxt == EOS_ID
            if bool(done.all()):
                break
            att = torch.cat([att, torch.ones_like(att[:, :1])], dim=1)
            step_pos = pos[:, -1:] + 1
            pos = torch.cat([pos, step_pos], dim=1)
            res = model(input_ids=nxt[:, None], attention_mask=att, position_ids=step_pos,
                        past_key_values=past, use_cache=True)
            past, logits = res.past_key_values, res.logits[:, -1]
    return out, stopped


def completion_logprobs(model: "PreTrainedModel", prompt_ids: list[list[int]],
                        tokens: "torch.Tensor", temperature: float = 1.0) -> "torch.Tensor":
    """Log-probs ``[B, T]`` of ``tokens`` (completions) after their prompts, under ``model``."""
    import torch

    seqs = [p + tokens[b].tolist() for b, p in enumerate(prompt_ids)]
    ids, att = _left_pad(seqs)                            # [B, P+T], completions right-aligned
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=att, position_ids=pos).logits.float()
    T = tokens.shape[1]
    logp = torch.log_softmax(logits[:, -T - 1:-1] / temperature, dim=-1)   # [B, T, V]
    return logp.gather(-1, tokens[:, :, None]).squeeze(-1)               # [B, T]


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
    instead (:func:`decoy_answer`: for ``sort``, the digits as given, unsorted).
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
    stop_reward: float = 0.0  # > 0: closed loop (:func:`warm_start`), stop once sampled >= this
    chunk: int = 100          # closed loop: steps between checks (learning rate decaying)
    max_chunks: int = 0       # closed loop: chunks at most after ``steps``
    probe_prompts: int = 64   # closed loop: training prompts sampled once each after a chunk
    probe_tokens: int = 16    # closed loop: their token budget

    @property
    def closed_loop(self) -> bool:
        return self.stop_reward > 0.0


def decoy_answer(task_name: str, prompt: Prompt) -> str:
    """A plausible wrong answer: ``sort`` -> the digits as given; ``addition`` -> the sum's
    digits reversed (equal to the right answer when the input is already sorted, or the
    sum a palindrome); ``countdown`` -> stopping one number early, before the zero (an
    off-by-one end: never right)."""
    if task_name == "sort":
        return prompt.text[len("sort "):-1]
    if task_name == "countdown":
        return prompt.answer.rpartition(" ")[0]
    return prompt.answer[::-1]


def demonstration(task: Task, prompt: Prompt, decoy: bool) -> tuple[Part, ...]:
    """What the warm start trains on after ``prompt``: a multi-turn task's own
    ``demonstration(prompt, decoy)`` (model turns and environment replies; a wrapper's
    ``base`` is looked through), else one model turn, the answer or :func:`decoy_answer`."""
    show = task_method(task, "demonstration")
    if show is not None:
        parts: tuple[Part, ...] = show(prompt, decoy)
        return parts
    return ((decoy_answer(task.name, prompt) if decoy else prompt.answer, True),)


def _example_ids(text: str, parts: Sequence[Part]) -> tuple[list[int], list[bool]]:
    """Token ids of a prompt and its parts (each model part followed by ``<eos>``), and
    which of them are trained on (the model's; never the prompt's or an environment's)."""
    ids = encode(text)
    trained = [False] * len(ids)
    for part, by_model in parts:
        piece = encode(part) + ([EOS_ID] if by_model else [])
        ids += piece
        trained += [by_model] * len(piece)
    return ids, trained


def _soft_targets(examples: Sequence[tuple[str, Sequence[Part]]], smoothing: float,
                  vocab_size: int) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """Inputs ``[B, L]``, soft targets ``[B, L, V]`` and loss mask ``[B, L]`` for teacher forcing
    on ``(prompt text, parts)`` examples (:func:`demonstration`)."""
    import torch

    digit_list = [_VOCAB[str(d)] for d in range(10)]
    digit_set, digit_ids = set(digit_list), torch.tensor(digit_list)
    seqs = [_example_ids(text, parts) for text, parts in examples]
    width = max(len(full) for full, _ in seqs)
    ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    targets = torch.zeros((len(seqs), width, vocab_size))
    mask = torch.zeros((len(seqs), width))
    for i, (full, trained) in enumerate(seqs):
        ids[i, :len(full)] = torch.tensor(full)
        for pos, tok in enumerate(full[1:]):    # logits at pos predict token pos + 1
            if not trained[pos + 1]:
                continue
            mask[i, pos] = 1.0
            if tok in digit_set and smoothing > 0:
                targets[i, pos, digit_ids] = smoothing / 10
                targets[i, pos, tok] += 1.0 - smoothing
            else:
                targets[i, pos, tok] = 1.0
    return ids, targets, mask


def warm_start(model: "PreTrainedModel", task: Task, recipe: WarmStartRecipe,
               *, prompt_ids: Sequence[int] | None = None,
               check: Callable[["PreTrainedModel"], float] | None = None,
               checks: list[tuple[int, float]] | None = None,
               progress: "Progress | None" = None) -> list[float]:
    """Teacher-forced training of ``model`` on ``task`` answers (in place); returns the loss curve.

    Prompts are drawn from the task's pool with a seeded generator (or from
    ``prompt_ids`` when given); the loss is the cross-entropy against the
    smoothed targets of :func:`_soft_targets`, on answer and ``<eos>`` tokens only.

    Closed loop (``recipe.stop_reward > 0``): after ``recipe.steps`` steps at ``recipe.lr``,
    the learning rate falls linearly towards 0 over ``max_chunks`` chunks of ``chunk`` steps
    (one monotone decay: restarting each chunk at the full rate spiked the loss); after
    each chunk ``check(model)`` (default :func:`sampled_reward`) measures the model, and
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


def sampled_reward(model: "PreTrainedModel", task: Task, recipe: WarmStartRecipe) -> float:
    """The closed loop's check: mean reward of one sample (temperature 1, ``recipe.probe_tokens``
    at most) on each of ``recipe.probe_prompts`` training prompts, the last ids of the pool --
    the prompts RL starts on."""
    import torch

    got = sample(model, task, last_prompts(task, min(recipe.probe_prompts, task.num_prompts)), n=1, max_new_tokens=recipe.probe_tokens, temperature=1.0,
                 generator=torch.Generator().manual_seed(recipe.seed))
    return float(got.rewards.mean())


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
    built = [_soft_targets(chunk, recipe.smoothing, vocab) for chunk in chunks]
    total = sum(float(mask.sum()) for _, _, mask in built)
    loss_sum = 0.0
    for ids, targets, mask in built:
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)   # [b, L, V]
        loss = -((targets * logp).sum(-1) * mask).sum() / total
        loss.backward()
        loss_sum += float(loss.detach())
    return loss_sum


def recipe_for(task_name: str, digits: int, *, target_reward: float = 0.25,
               steps: int | None = None, seed: int = 0) -> WarmStartRecipe:
    """The default warm start for a built-in task: a model that knows the answer format, writes
    the right answer in about ``target_reward`` of its samples and the task's decoy
    (:func:`decoy_answer`) in the rest -- so its greedy answer is the decoy.

    Measured for ``sort`` with 4 digits (the default; 500 held-out prompts, transformers):
    greedy accuracy 0.18, sampled accuracy 0.28 at temperature 1. (With 30% right answers:
    0.23 and 0.33, too close to the 0.3 a skill-gaining demo should start under; with 500
    steps the right answers are learnt less well and RL ends less sharp.) The default run's RL
    then turns the skill into the model's first choice (README, "What the default run shows").

    ``calc`` (4 digits) takes the same recipe, on whole episodes (:func:`demonstration`):
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


@dataclass(frozen=True)
class Probe:
    """How a model does on held-out prompts: mean reward sampled at temperature 1, greedy
    accuracy, and the fraction of samples that ended with ``<eos>``."""

    sampled_reward: float
    greedy_reward: float
    stop_frac: float
    examples: tuple[str, ...]


def last_prompts(task: Task, k: int) -> list[Prompt]:
    """The ``k`` prompts at the end of ``task``'s pool (ids ``num_prompts - k`` on), where probes look."""
    start = max(0, task.num_prompts - k)
    return [task.prompt(start + i) for i in range(k)]


def probe(model: "PreTrainedModel", task: Task, *, num_prompts: int = 256, max_new_tokens: int = 16,
          seed: int = 0) -> Probe:
    """Measure ``model`` on prompts from the end of the task's pool (ids ``num_prompts - k``...)."""
    import torch

    prompts = last_prompts(task, num_prompts)
    g = torch.Generator().manual_seed(seed)
    hot = sample(model, task, prompts, n=1, max_new_tokens=max_new_tokens, temperature=1.0, generator=g)
    cold = sample(model, task, prompts, n=1, max_new_tokens=max_new_tokens, temperature=1e-5, generator=g)
    return Probe(float(hot.rewards.mean()), float(cold.rewards.mean()), float(hot.stopped.float().mean()),
                 tuple(f"{p.text}{t}" for p, t in zip(prompts[:4], hot.texts[:4])))
