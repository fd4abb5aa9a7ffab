"""Multi-turn episodes on the built-in model in transformers: what sizes a multi-turn task's
warm start (its probe), as :func:`~pipeline_rl.models.probes.probe` does for one turn.

Not the training system (the rollout worker runs episodes on vLLM); the same episode
shape, token in and token out: a model turn is sampled until ``<eos>`` (kept in the
sequence) or ``max_new_tokens``; the environment reads the turn decoded with ``<eos>``
kept; its reply's tokens (``EnvReply.token_ids``, else ``EnvReply.text`` encoded) are
appended and the model goes on from the whole sequence. An episode the environment has
not ended after ``max_turns`` model turns scores 0.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from pipeline_rl.models.tiny_llama import EOS
from pipeline_rl.models.char_ids import EOS_ID, decode, encode
from pipeline_rl.models.hf_sampling import generate
from pipeline_rl.models.probes import Probe, last_prompts
from pipeline_rl.tasks.base import Prompt, Task
from pipeline_rl.tasks.env import EnvFactory, EnvReply, task_env_factory

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Episode:
    """One finished episode: ``text`` is everything after the prompt (model turns with their
    ``<eos>``, the environment's replies), ``reward`` in [0, 1], ``turns`` the model turns
    taken, ``done`` whether the environment ended it (else it ran out of turns: reward 0).
    ``tokens``: the ids after the prompt, exactly as generated and appended;
    ``by_model[i]``: whether ``tokens[i]`` was sampled (else the environment's; same length)."""

    prompt: Prompt
    text: str
    reward: float
    turns: int
    done: bool
    tokens: tuple[int, ...] = ()
    by_model: tuple[bool, ...] = ()


def _now(value: _T | Awaitable[_T]) -> _T:
    """``value``, awaited to its end when an ``async def`` environment returned an awaitable."""
    if inspect.isawaitable(value):
        async def wait() -> _T:
            return await value
        return asyncio.run(wait())
    return value


def turn_tokens(row: Sequence[int]) -> list[int]:
    """A generated row cut after its first ``<eos>`` (the padding after it dropped)."""
    row = list(row)
    return row[:row.index(EOS_ID) + 1] if EOS_ID in row else row


def run_episodes(model: "PreTrainedModel", prompts: Sequence[Prompt], make_env: EnvFactory, *,
                 max_turns: int, max_new_tokens: int, temperature: float,
                 generator: "torch.Generator") -> list[Episode]:
    """Run one episode per prompt, all turns of a round batched (see the module doc)."""
    envs = [make_env() for _ in prompts]
    for env, p in zip(envs, prompts):
        _now(env.reset(p))
    seqs = [encode(p.text) for p in prompts]
    texts = ["" for _ in prompts]
    owners: list[list[bool]] = [[] for _ in prompts]
    starts = [len(seq) for seq in seqs]
    ended: dict[int, tuple[float, int]] = {}
    for turn in range(1, max_turns + 1):
        live = [i for i in range(len(prompts)) if i not in ended]
        if not live:
            break
        out, _ = generate(model, [seqs[i] for i in live], max_new_tokens=max_new_tokens,
                          temperature=temperature, generator=generator)
        for row, i in enumerate(live):
            tokens = turn_tokens(out[row].tolist())
            said = decode(tokens) + (EOS if tokens[-1:] == [EOS_ID] else "")
            seqs[i] += tokens
            texts[i] += said
            owners[i] += [True] * len(tokens)
            reply: EnvReply = _now(envs[i].step(said))
            if reply.done:
                ended[i] = (float(reply.reward or 0.0), turn)
                continue
            appended = list(reply.token_ids) if reply.token_ids is not None else encode(reply.text)
            seqs[i] += appended
            texts[i] += reply.text
            owners[i] += [False] * len(appended)
    return [Episode(p, texts[i], *(ended[i] if i in ended else (0.0, max_turns)), i in ended,
                    tuple(seqs[i][starts[i]:]), tuple(owners[i]))
            for i, p in enumerate(prompts)]


def probe_episodes(model: "PreTrainedModel", task: Task, *, num_prompts: int = 256, max_turns: int = 4,
                   max_new_tokens: int = 32, seed: int = 0) -> Probe:
    """:func:`~pipeline_rl.models.probes.probe` for a multi-turn task (one that supplies an
    environment, :func:`pipeline_rl.tasks.env.task_env_factory`): mean episode reward
    sampled at temperature 1 and greedy, and the share of sampled episodes the environment
    ended within ``max_turns``; prompts from the end of the task's pool."""
    import torch

    make_env = task_env_factory(task)
    if make_env is None:
        raise ValueError(f"task {task.name} supplies no environment: probe it with probes.probe")
    prompts = last_prompts(task, num_prompts)
    g = torch.Generator().manual_seed(seed)
    runs = [run_episodes(model, prompts, make_env, max_turns=max_turns, max_new_tokens=max_new_tokens,
                         temperature=t, generator=g) for t in (1.0, 1e-5)]
    hot, cold = ([e.reward for e in eps] for eps in runs)
    return Probe(sum(hot) / len(hot), sum(cold) / len(cold), sum(e.done for e in runs[0]) / len(prompts),
                 tuple(f"{e.prompt.text}{e.text}" for e in runs[0][:4]))
