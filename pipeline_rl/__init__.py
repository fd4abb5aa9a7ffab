"""pipeline_rl: fully asynchronous pipeline RL for language models.

Data path: ``rollout/`` (vLLM) -> ``buffer/`` (ZeroMQ link and replay buffer) ->
``training/`` (DeepSpeed, with ``correction/``) -> ``weight_sync/`` (back into the rollout
workers); ``run/`` conducts, ``actors/`` are the Ray processes (``docs/layout.md``).
Importing this package has no side effects and imports no torch.
"""

__version__ = "0.1.0"
