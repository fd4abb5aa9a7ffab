"""``word_problems`` as a chat agent: a pretrained chat model answering through the rollout
worker's OpenAI endpoint, the way agent code written against the API asks::

    --model smollm2-135m-instruct --task.name word_problems \\
        --task.agent pipeline_rl.tasks.word_problems_agent:solve

One ``/v1/chat/completions`` request per episode, with the problem as the user's message (the
endpoint renders it through the model's own chat template, as the environment-free form does),
scored by the task's own reward (math-verify against the reference answer). Sampling is the
run's (``--rollout.temperature``, ``--rollout.max_new_tokens``): the agent names none.
"""

from __future__ import annotations

from typing import Any

from pipeline_rl.tasks.base import Prompt
from pipeline_rl.tasks.math_reward import math_reward

#: The model name the agent sends (the endpoint serves one model and does not read it).
MODEL = "policy"


async def solve(client: Any, sample: Prompt) -> dict[str, float]:
    """One episode: ask the problem as the user, score the answer; ``tokens`` is the answer's
    length in tokens (a metric)."""
    reply = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": sample.question}])
    answer = reply.choices[0].message.content or ""
    tokens = float(reply.usage.completion_tokens) if reply.usage is not None else 0.0
    return {"reward": math_reward(answer, sample.answer), "tokens": tokens}
