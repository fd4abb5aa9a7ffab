"""Slots of the statistics vector shared by the fused kernel and the reference path."""

#: Slots of the float64 statistics vector (all sums over valid tokens unless noted).
(S_MASK, S_VALID, S_R, S_K3, S_EM1, S_RMAX, S_RMIN, S_W, S_W2, S_CLIP, S_KEPT, S_SEQ,
 S_SEQ_DROP, S_LOSS) = range(14)
NUM_STATS = 14

