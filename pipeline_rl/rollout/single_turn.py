"""The single-turn rollout: one request on the engine, its sequence the episode.

The plainest :class:`~pipeline_rl.rollout.rollout_shape.Rollout`: it awaits one
:class:`~pipeline_rl.rollout.rollout_shape.Generate` of the prompt under its sampling, with the episode's own key as the request id (``GROUP:INDEX``, or an evaluation's
``eval:EVAL:PROMPT:SAMPLE``). The driver adds a group's ``n`` first requests in one
``add_copies`` (the prompt prepared once), as the worker did before rollouts had one shape.
"""

from __future__ import annotations

from pipeline_rl.rollout.engines.engine import FinishedSequence, SamplingConfig
from pipeline_rl.rollout.request_key import RequestKey
from pipeline_rl.rollout.rollout_shape import FinishedEpisode, Generate, Trace
from pipeline_rl.tasks.base import Prompt


def sequence_episode(key: RequestKey, seq: FinishedSequence) -> FinishedEpisode:
    """A finished sequence as its episode: one trace, every token the model's, scored by the
    task's reward on its text (handed its token ids)."""
    return FinishedEpisode(key, (Trace(seq.token_ids, seq.logprobs, seq.versions, seq.finish_reason),),
                           seq.text, reward_ids=seq.token_ids)


class SingleTurn:
    """See the module docstring. Holds nothing."""

    async def __call__(self, key: RequestKey, prompt: Prompt, prompt_ids: tuple[int, ...],
                       sampling: SamplingConfig) -> FinishedEpisode:
        seq = await Generate(key.to_id(), prompt_ids, sampling)
        return sequence_episode(key, seq)

    def prompt_ids(self, prompt: Prompt) -> None:
        """The prompt's text is the start (encoded by the worker)."""
        return None

    def close(self) -> None:
        pass
