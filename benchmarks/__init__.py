"""The project's benchmarks, one harness (``benchmarks/common.py``): run each from the
repository root as ``python -m benchmarks.NAME [flags]``; ``--help`` documents its flags.
Figures of the runs behind the README are in ``benchmarks/results/``."""
