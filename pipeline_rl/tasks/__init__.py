"""Verifiable tasks: deterministic prompt pools with programmatic rewards.

Built-in (CPU default): ``addition``, ``sort`` and ``countdown`` (:mod:`pipeline_rl.tasks.builtin`),
and ``calc``, multi-turn with a calculator tool (:mod:`pipeline_rl.tasks.calc`).
User data: ``dataset``, a local JSONL / JSON / Parquet / Arrow / CSV file (or a
``save_to_disk`` folder) scored by math answer matching
(:mod:`pipeline_rl.tasks.dataset`, :mod:`pipeline_rl.tasks.math_reward`).
Over any task: the tokenizer's chat template and a plug-in reward, local or remote
(:mod:`pipeline_rl.tasks.chat`, :mod:`pipeline_rl.tasks.plugin`,
:mod:`pipeline_rl.tasks.remote_reward`).
A task as the workers see it: :mod:`pipeline_rl.tasks.build`. No module here imports torch,
``datasets`` or transformers at its top.
"""
