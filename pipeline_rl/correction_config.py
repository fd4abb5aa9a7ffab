"""``--correction.*``: the off-policy correction, a preset or a composition (docs/objectives.md).

Its own module for its size; ``pipeline_rl.config`` re-exports it. Stdlib and pydantic only (``--help``
stays instant). A bad combination is one line naming the flag (``correction.weight: ...``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline_rl.config_section import Section

CorrectionName = Literal["none", "tis", "icepop", "seq-mask-tis", "m2po", "custom"]
WeightLevel = Literal["none", "token", "sequence"]
RejectLevel = Literal["none", "token", "sequence", "geometric"]


class CorrectionConfig(Section):
    """Off-policy correction: a preset or a composition (docs/design.md section 4, docs/objectives.md)."""

    type: CorrectionName = Field("tis", description="A preset: none, tis, icepop, seq-mask-tis or m2po (M2PO, "
                                 "arXiv 2510.01161: the token ratio as weight, uncapped, under M2PO's mask); or "
                                 "custom: the composition of --correction.weight and --correction.reject. "
                                 "--correction.veto and --correction.m2po add to any of them.")
    tis_cap: float = Field(2.0, gt=1.0, le=1e6, description="TIS: cap C on exp(r).")
    icepop_alpha: float = Field(0.5, gt=0.0, lt=1.0, description="ICEPOP: lower ratio bound.")
    icepop_beta: float = Field(5.0, gt=1.0, le=1e6, description="ICEPOP: upper ratio bound.")
    seq_lo: float = Field(0.5, gt=0.0, lt=1.0, description="Seq-Mask-TIS: lower geometric-mean bound.")
    seq_hi: float = Field(2.0, gt=1.0, le=1e6, description="Seq-Mask-TIS: upper geometric-mean bound.")
    seq_cap: float = Field(2.0, gt=1.0, le=1e6, description="Seq-Mask-TIS: per-token cap C.")
    weight: WeightLevel | None = Field(None, description="custom: the importance weight: none, token "
                                       "(min(pi/mu, cap) per token) or sequence (min(prod_t pi/mu, cap) on every "
                                       "token of the sequence). Unset: none.")
    weight_cap: float | None = Field(None, gt=0.0, le=1e6, description="custom: the weight's cap (unset: "
                                     "uncapped).")
    reject: RejectLevel | None = Field(None, description="custom: rejection: none, token (a token whose pi/mu "
                                       "is outside [reject_lo, reject_hi]), sequence (a sequence whose prod_t "
                                       "pi/mu is outside) or geometric (a sequence whose geometric mean "
                                       "exp(mean_t log pi/mu) is outside). Unset: none.")
    reject_lo: float | None = Field(None, ge=0.0, le=1e6, description="custom: the rejection's lower bound "
                                    "(unset: 1 / reject_hi, as verl).")
    reject_hi: float | None = Field(None, gt=0.0, le=1e6, description="custom: the rejection's upper bound "
                                    "(needed by a rejection).")
    veto: float | None = Field(None, gt=0.0, lt=1.0, description="Reject a whole sequence when one of its "
                               "tokens has pi/mu below this (verl's rollout_token_veto_threshold, e.g. 1e-4); "
                               "adds to any type. Unset: off.")
    m2po: bool = Field(False, description="Add M2PO's mask (arXiv 2510.01161) to any type: the kept tokens "
                       "with the largest (log pi/mu)^2 are masked until their mean is at most "
                       "--correction.m2po_tau (the m2po preset has it).")
    m2po_tau: float = Field(0.04, gt=0.0, le=100.0, description="M2PO: the bound on the batch's second "
                            "moment mean((log pi/mu)^2) (the paper's 0.04).")

    @model_validator(mode="after")
    def _ordered(self) -> "CorrectionConfig":
        if not self.icepop_alpha < self.icepop_beta:
            raise ValueError(f"correction.icepop_alpha: must be < correction.icepop_beta "
                             f"(got {self.icepop_alpha} >= {self.icepop_beta})")
        if not self.seq_lo < self.seq_hi:
            raise ValueError(f"correction.seq_lo: must be < correction.seq_hi "
                             f"(got {self.seq_lo} >= {self.seq_hi})")
        return self

    @model_validator(mode="after")
    def _composed(self) -> "CorrectionConfig":
        parts = {"weight": self.weight, "weight_cap": self.weight_cap, "reject": self.reject,
                 "reject_lo": self.reject_lo, "reject_hi": self.reject_hi}
        if self.type != "custom":
            for name, value in parts.items():
                if value is not None:
                    raise ValueError(f"correction.{name}: composes --correction.type custom; {self.type} is a "
                                     "preset (its own flags set it)")
            return self
        if self.weight_cap is not None and self.weight in (None, "none"):
            raise ValueError("correction.weight_cap: caps an importance weight; --correction.weight is none")
        rejects = self.reject not in (None, "none")
        if not rejects and (self.reject_lo is not None or self.reject_hi is not None):
            flag = "reject_lo" if self.reject_lo is not None else "reject_hi"
            raise ValueError(f"correction.{flag}: bounds a rejection; --correction.reject is none")
        if rejects and self.reject_hi is None:
            raise ValueError(f"correction.reject_hi: --correction.reject {self.reject} needs an upper bound")
        lo, hi = self.reject_bounds()
        if rejects and not lo < hi:
            raise ValueError(f"correction.reject_lo: must be < correction.reject_hi (got {lo} >= {hi})")
        return self

    def reject_bounds(self) -> tuple[float, float]:
        """custom's rejection interval ``[lo, hi]`` (``lo`` unset: ``1 / hi``; no rejection: ``[0, inf]``)."""
        if self.reject_hi is None:
            return 0.0, float("inf")
        return (1.0 / self.reject_hi if self.reject_lo is None else self.reject_lo), self.reject_hi
