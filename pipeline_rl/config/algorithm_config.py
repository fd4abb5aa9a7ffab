"""``--algorithm.*``: the advantage estimator and the policy objective (docs/objectives.md). A
section of :class:`pipeline_rl.config.Config`, in a module of its own like ``lora_config.py``; it
imports no torch, vLLM or Ray.

Invariants: the KL penalty's estimator is k3 whenever the penalty is on (k1's gradient pulls towards
nothing); the ratio flags (``ppo_clip_low``/``_high``, ``ratio_reference``) are set only with a ratio
objective, never with reinforce.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline_rl.config_section import Section

RatioReference = Literal["proximal", "behaviour"]
AdvantageName = Literal["grpo", "dr_grpo", "rloo", "reinforce++", "reinforce++-baseline"]
LossName = Literal["reinforce", "ppo", "gspo", "gspo-token", "cispo"]
NormName = Literal["token", "sequence", "constant"]
KLEstimator = Literal["k1", "k3"]


class AlgorithmConfig(Section):
    """Advantage estimator and policy objective (docs/design.md section 4)."""

    advantage: AdvantageName = Field("grpo", description="grpo ((r - group mean) / (group std + 1e-6)), "
                                     "dr_grpo (r - group mean), rloo (r - mean of the group's other "
                                     "rewards), reinforce++ (r) or reinforce++-baseline (r - group mean), "
                                     "the last two then whitened with the token-weighted mean and std of "
                                     "the step's whole batch over all trainer ranks (OpenRLHF's reinforce "
                                     "and reinforce_baseline, gamma 1). r is the completion's reward, with "
                                     "no KL in it: the KL is a loss term (--algorithm.kl_coef), not a "
                                     "per-token reward as in OpenRLHF's reinforce.")
    loss: LossName = Field("reinforce", description="reinforce (w A logpi); ppo (token ratio, clipped); gspo (GSPO, "
                           "arXiv 2507.18071: the geometric mean of the token ratios, clipped per sequence); gspo-token "
                           "(its per-token gradient); cispo (CISPO, arXiv 2506.13585: a clipped stop-gradient ratio on "
                           "every token's logpi). Ratios: --algorithm.ratio_reference (docs/objectives.md).")
    normalization: NormName = Field("token", description="Loss normalisation: tokens in batch, "
                                    "per-sequence mean, or a constant length (Dr. GRPO).")
    constant_length: int = Field(1024, ge=1, description="N for --algorithm.normalization constant.")
    ppo_clip: float = Field(0.2, gt=0.0, lt=1.0, description="Clip epsilon of ppo, gspo(-token) and cispo's "
                            "weight: [1 - eps, 1 + eps], unless --algorithm.ppo_clip_low/_high set a side.")
    ppo_clip_low: float | None = Field(None, gt=0.0, le=1.0, description="Lower clip epsilon: the ratio is "
                                       "clipped at 1 - this (1: no lower bound, as CISPO). Unset: --algorithm.ppo_clip.")
    ppo_clip_high: float | None = Field(None, gt=0.0, le=1000.0, description="Upper clip epsilon: clipped at "
                                        "1 + this (DAPO's clip-higher: 0.28). Unset: --algorithm.ppo_clip.")
    ratio_reference: RatioReference = Field("proximal", description="The ratio objectives' denominator: proximal "
                                            "(the trainer at the step's start, AReaL's decoupled PPO) or behaviour "
                                            "(the generator; the correction then keeps its masks, not its weight).")
    ppo_epochs: int = Field(1, ge=1, le=64, description="Passes over each batch (ppo, gspo, gspo-token, cispo).")
    kl_coef: float = Field(0.0, ge=0.0, description="KL penalty to the reference policy (0 = off).")
    skip_zero_variance: bool = Field(False, description="Drop every group whose rewards are all equal "
                                     "(zero advantage: a training pass that teaches nothing) at the buffer, "
                                     "and generate more instead (DAPO's dynamic sampling), so each batch "
                                     "carries signal; counted on the step line (skip N) and in metrics "
                                     "(zero_variance_groups). Off: such groups are trained like any other.")
    entropy_coef: float = Field(0.0, ge=0.0, le=10.0, description="Entropy bonus: subtract this times the "
                                "policy's entropy (full distribution at the sampling temperature) over the "
                                "trained tokens, normalised like the loss (0 = off).")
    kl_estimator: KLEstimator = Field("k3", description="KL estimator for the penalty (k3; k1 "
                                      "is refused as a loss term: its gradient is that of log pi "
                                      "whatever the reference).")

    @model_validator(mode="after")
    def _kl_estimator_is_a_loss(self) -> "AlgorithmConfig":
        if self.kl_coef > 0 and self.kl_estimator == "k1":
            raise ValueError("algorithm.kl_estimator: k1 as a loss term has the gradient of log pi "
                             "whatever the reference is (it pulls towards nothing); use k3")
        return self

    @model_validator(mode="after")
    def _ratio_flags_need_a_ratio(self) -> "AlgorithmConfig":
        given = [f for f in ("ppo_clip_low", "ppo_clip_high") if getattr(self, f) is not None]
        if self.loss == "reinforce" and (given or self.ratio_reference != "proximal"):
            raise ValueError(f"algorithm.{(given or ['ratio_reference'])[0]}: applies to a ratio objective "
                             "(--algorithm.loss ppo, gspo, gspo-token or cispo); reinforce has no ratio")
        return self
