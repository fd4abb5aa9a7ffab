"""``calc`` as an agent: the same episodes as the task's own environment (``tasks/calc.py``),
written as agent code against the OpenAI API and run through the rollout worker's endpoint::

    --task.name calc --task.agent pipeline_rl.tasks.calc_agent:calc

Each turn is a ``/v1/completions`` request continuing the episode's text: the prompt, then
every model turn and the calculator's reply. The endpoint splices its own sampled ids (the
``<eos>`` ending each turn included) in place of the turns' text
(``rollout/agent_tokens.text_prompt_ids``), so the episode the trainer gets is token for
token the environment form's: ``calc 4821*7396=[4821*7396]<eos>=35655316;35655316<eos>``.
"""

from __future__ import annotations

from typing import Any

from pipeline_rl.tasks.base import Prompt
from pipeline_rl.tasks.calc import CalcEnv

#: Model turns at most (``--task.max_turns``' default for the environment form).
MAX_TURNS = 4


async def calc(client: Any, sample: Prompt) -> dict[str, float]:
    """One episode: ask, run the calculator on a call, go on; the last turn is scored."""
    env = CalcEnv()
    env.reset(sample)
    text = sample.text
    for turn in range(1, MAX_TURNS + 1):
        answer = (await client.completions.create(model="policy", prompt=text)).choices[0].text
        reply = env.step(answer)
        if reply.done:
            return {"reward": float(reply.reward or 0.0), "turns": float(turn)}
        text += answer + reply.text
    return {"reward": 0.0, "turns": float(MAX_TURNS)}
