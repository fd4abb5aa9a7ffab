"""A pure-torch GRPO loop on the built-in model: checks that a warm-started model learns under RL.

This is not the training system (that is vLLM + DeepSpeed + ZeroMQ + Ray); it
runs the same objective (the project's own advantages and loss) in one process
with transformers sampling, to size the built-in default:
``groups`` prompts x ``n`` samples at temperature 1, GRPO advantages (group mean
and std), a REINFORCE loss with token normalisation and truncated importance
weights ``min(exp(logp - logp_behav), cap)`` against a behaviour policy
``lag`` optimizer steps old (as an asynchronous run at that staleness), AdamW,
gradient-norm clip. Used by ``scripts/warmstart.py --rl-check`` and a test.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pipeline_rl.config import AlgorithmConfig, PresetCorrection
from pipeline_rl.correction.advantages import compute_advantages
from pipeline_rl.correction.loss import PolicyBatch, policy_loss
from pipeline_rl.models.hf_sampling import completion_logprobs, sample
from pipeline_rl.models.probes import probe
from pipeline_rl.tasks.base import Task


@dataclass(frozen=True)
class RLProbeConfig:
    """Knobs of the GRPO check (defaults: the pipeline's CPU defaults)."""

    steps: int = 150
    groups: int = 4
    n: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    lr: float = 1e-3
    lag: int = 2
    tis_cap: float = 2.0
    grad_clip: float = 1.0
    adam_eps: float = 1e-8
    betas: tuple[float, float] = (0.9, 0.999)
    seed: int = 0
    probe_every: int = 0  # 0: no held-out probe during the run


@dataclass
class RLProbeResult:
    """Per-step batch mean rewards, held-out probes ``(step, sampled, greedy)``, wall time."""

    rewards: list[float] = field(default_factory=list)
    probes: list[tuple[int, float, float]] = field(default_factory=list)
    wall_s: float = 0.0

    def moving_mean(self, window: int = 10) -> list[float]:
        """Mean reward over the last ``window`` steps, at every step."""
        return [sum(self.rewards[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window))
                for i in range(len(self.rewards))]

    def steps_to(self, level: float, window: int = 10) -> int | None:
        """First step (1-based) at which the ``window``-step moving mean reaches ``level``."""
        for i, m in enumerate(self.moving_mean(window)):
            if i + 1 >= window and m >= level:
                return i + 1
        return None


def grpo_probe(model_dir: str | Path, task: Task, cfg: RLProbeConfig,
               on_step: Callable[[int, float], None] | None = None) -> RLProbeResult:
    """Run ``cfg.steps`` GRPO steps from the model in ``model_dir``; returns the reward curve."""
    import torch
    from transformers import LlamaForCausalLM

    policy = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    behaviour = copy.deepcopy(policy)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0, eps=cfg.adam_eps, betas=cfg.betas)
    gen = torch.Generator().manual_seed(cfg.seed)
    history = [copy.deepcopy(policy.state_dict())]
    algo, corr = AlgorithmConfig(), PresetCorrection(type="tis", tis_cap=cfg.tis_cap)  # GRPO, token norm.
    result = RLProbeResult()
    t0 = time.perf_counter()
    next_prompt = cfg.seed * 1_000_003 % max(1, task.num_prompts // 2)
    for step in range(cfg.steps):
        behaviour.load_state_dict(history[max(0, len(history) - 1 - cfg.lag)])
        behaviour.eval()
        prompts = [task.prompt(next_prompt + i) for i in range(cfg.groups)]
        next_prompt += cfg.groups
        ro = sample(behaviour, task, prompts, n=cfg.n, max_new_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature, generator=gen)
        with torch.no_grad():
            behav_logp = completion_logprobs(behaviour, ro.prompt_ids, ro.tokens, cfg.temperature)  # [B, T]
        adv = compute_advantages("grpo", ro.rewards.view(cfg.groups, cfg.n)).view(-1)             # [B]
        policy.train()
        logp = completion_logprobs(policy, ro.prompt_ids, ro.tokens, cfg.temperature)              # [B, T]
        loss, _ = policy_loss(PolicyBatch(logp, behav_logp, ro.mask, adv), algo, corr)
        opt.zero_grad()
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
        opt.step()
        history = (history + [copy.deepcopy(policy.state_dict())])[-(cfg.lag + 1):]
        result.rewards.append(float(ro.rewards.mean()))
        if on_step is not None:
            on_step(step + 1, result.rewards[-1])
        if cfg.probe_every and (step + 1) % cfg.probe_every == 0:
            policy.eval()
            p = probe(policy, task, num_prompts=128, max_new_tokens=cfg.max_new_tokens)
            result.probes.append((step + 1, p.sampled_reward, p.greedy_reward))
    result.wall_s = time.perf_counter() - t0
    return result
