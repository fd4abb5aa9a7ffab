"""pipeline_rl: fully asynchronous pipeline RL for language models.

Data path: ``actors/rollout_worker`` (vLLM) -> ``buffer/`` (ZeroMQ link and
replay buffer) -> ``actors/trainer`` (DeepSpeed, with ``correction/``) ->
``actors/weights`` (weight transport back into the rollout workers).
Importing this package has no side effects and imports no torch.
"""

__version__ = "0.1.0"
