"""Multi-turn episodes in the rollout worker: the environment's rollout.

:class:`EnvRollout` is a :class:`~pipeline_rl.rollout.rollout_shape.Rollout` (one async
function from a prompt to a finished episode, run by ``rollout/rollout_driver.py``). An episode starts from a prompt: its environment is reset, then the engine generates the
model's turn; the finished turn goes to the environment, whose reply is appended, and the
engine generates the next turn from the whole sequence; until the environment says
``done``, the model has taken ``--task.max_turns`` turns (finish reason ``turns``; the
environment still sees the last one, and may score it), or the context is full (``length``). A group is still ``n`` episodes of one prompt.

Token in, token out (:class:`Episode`): the sequence is the engine's own token ids of each
turn, with their behaviour log-probs and the versions that sampled them, and the reply's
token ids (encoded once, never decoded again) with a loss mask of 0. Versions grow along
the model's tokens: every turn is sampled after the one before it.

Environment calls run off the engine loop (:class:`EnvCalls`, through the shared
``rollout.bounded_calls`` helper: ``async def`` methods on an event loop of their own, others
on ``--task.env_concurrency`` threads, each call bounded by ``--task.env_timeout_s``; a call
past it frees its slot at once, its thread replaced); replies come back to the engine loop
(the episode awaits an ``OffLoop`` the driver resumes at the loop's next pass), so a slow or
hung environment delays its own episode, never generation. A failing environment (raises, answers with something that is not an
``EnvReply``, times out) ends its episode with reward 0 and is counted (``env_errors`` /
``env_timeouts``, apart from the reward's failures; the first one is a console line);
``--task.env_errors fail`` ends the run at the first, and an environment that failed on all
of its first ``REWARD_FAILURES_FATAL`` episodes ends it too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pipeline_rl.calls import LoopThread, first_line
from pipeline_rl.config import TaskConfig
from pipeline_rl.rollout.bounded_calls import BoundedCalls, Outcome
from pipeline_rl.rollout.chat_turns import ChatTurns
from pipeline_rl.rollout.engines.engine import FinishedSequence, GenerationEngine, SamplingConfig
from pipeline_rl.rollout.request_key import RequestKey
from pipeline_rl.rollout.rollout_shape import EndKind, EpisodeEnd, FinishedEpisode, Generate, OffLoop, Trace
from pipeline_rl.samples import FinishReason
from pipeline_rl.tasks.base import Prompt
from pipeline_rl.tasks.chat import has_chat_template
from pipeline_rl.tasks.env import EnvFactory, Environment, EnvReply
from pipeline_rl.tasks.messages import Message



@dataclass(slots=True)
class Episode:
    """One environment episode in flight (engine loop only). ``key``: its turns' key without the turn
    (``key.at_turn(t)`` is turn ``t``'s request). Invariants: ``tokens``, ``logprobs``,
    ``versions`` and ``mask`` have one entry per token after the prompt; the model's tokens
    (mask 1) keep the engine's log-probs and versions, non-decreasing; the environment's
    (mask 0) hold 0 and the version before them."""

    key: RequestKey
    prompt: Prompt
    prompt_ids: tuple[int, ...]
    env: Environment
    sampling: SamplingConfig
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)   # the model's turns, decoded
    turns: int = 0
    reward: float | None = None
    finish: FinishReason = "stop"                     # stop: the environment ended it
    failed: str | None = None                         # the environment's failure, one line
    ended: EndKind = "done"                           # how it ended (the turn metrics)
    env_s: float = 0.0                                # seconds its environment calls took
    tool_calls: int = 0                               # tool calls its environment reported
    tool_errors: int = 0                              # of which failed (a malformed or unknown call)

    def add_turn(self, seq: FinishedSequence) -> None:
        self.tokens += seq.token_ids.tolist()
        self.logprobs += seq.logprobs.tolist()
        self.versions += seq.versions.tolist()
        self.mask += [1] * len(seq.token_ids)
        self.texts.append(seq.text)
        self.turns += 1

    def add_reply(self, ids: list[int]) -> None:
        last = self.versions[-1] if self.versions else 0
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [last] * len(ids)
        self.mask += [0] * len(ids)

    @property
    def text(self) -> str:
        """The model's turns, as the task's reward reads them when the environment gives none."""
        return "".join(self.texts)

    def finished(self) -> FinishedEpisode:
        """The episode as the driver takes it: one trace after the prompt, its reward when the
        environment gave one, its turn metrics."""
        trace = Trace(np.array(self.tokens, np.int32), np.array(self.logprobs, np.float32),
                      np.array(self.versions, np.int32), self.finish, np.array(self.mask, np.uint8))
        return FinishedEpisode(self.key, (trace,), self.text, self.reward,
                               end=EpisodeEnd(self.ended, self.turns, self.env_s, self.tool_calls, self.tool_errors))


class EnvCalls:
    """Environment calls off the engine loop (see the module docstring): ``call(fn, arg,
    done)`` runs ``fn(arg)`` through the shared :class:`BoundedCalls` (a hung call frees its
    slot at its timeout, its thread replaced) and hands ``done`` the :class:`Outcome`, on
    the calls' own thread."""

    def __init__(self, concurrency: int, timeout_s: float, name: str) -> None:
        self._calls = BoundedCalls(concurrency, timeout_s, f"env-{name}", "--task.env_timeout_s")
        self._loops = LoopThread(f"envs-{name}")

    def call(self, fn: Callable[[Any], Any], arg: Any, done: Callable[[Outcome], None]) -> None:
        self._loops.submit(self._run(fn, arg, done))

    async def _run(self, fn: Callable[[Any], Any], arg: Any, done: Callable[[Outcome], None]) -> None:
        done(await self._calls.run(fn, arg))

    @property
    def abandoned(self) -> int:
        """Environment calls still running past their timeout (their threads replaced)."""
        return self._calls.abandoned

    def close(self) -> None:
        """Cancel the calls still waiting, stop the loop and release the threads (an
        environment call still running is left to finish on its own)."""
        self._loops.close()
        self._calls.close()


class EnvRollout:
    """The environment's rollout (see the module docstring): ``await rollout(key, ...)`` runs one
    episode, its environment made by ``factory`` and called off the loop, its turns on
    ``engine``; ``failed(line, timeout)`` reports an environment's failure (one line)."""

    def __init__(self, factory: EnvFactory, cfg: TaskConfig, engine: GenerationEngine, max_model_len: int,
                 name: str, failed: Callable[[str, bool], None]) -> None:
        self.factory, self.cfg, self._engine, self._max_len, self._failed = factory, cfg, engine, max_model_len, failed
        self.env_name = cfg.env or getattr(factory, "__qualname__", type(factory).__name__)
        self._calls = EnvCalls(cfg.env_concurrency, cfg.env_timeout_s, name)
        self._tokenizer: Any = getattr(engine, "tokenizer", None)
        schemas = getattr(factory, "tool_schemas", None)
        self.tools: list[dict[str, Any]] | None = schemas() if callable(schemas) else None
        self._templated = cfg.chat_template == "auto" and has_chat_template(self._tokenizer)
        self._chat_turns: ChatTurns | None = None

    @property
    def _chat(self) -> ChatTurns | None:
        """The chat template's turns, made at first use (an episode of messages or tools)."""
        if self._chat_turns is None and self._templated:
            self._chat_turns = ChatTurns(self._tokenizer, self.tools)
        return self._chat_turns

    def prompt_ids(self, prompt: Prompt) -> tuple[int, ...] | None:
        """A chat model's episode start: the prompt's messages (or its user turn, after
        ``--task.system_prompt``) rendered with the environment's tools; None when the
        prompt's own text is the start (no chat template, or neither messages nor tools)."""
        if not self._templated or (prompt.messages is None and not self.tools):
            return None
        chat = self._chat
        assert chat is not None
        messages = prompt.messages
        if messages is None:
            first = [Message("system", self.cfg.system_prompt)] if self.cfg.system_prompt else []
            messages = (*first, Message("user", prompt.raw_prompt if prompt.raw_prompt is not None else prompt.text))
        return tuple(self._engine.encode(chat.prompt_text(messages), add_special_tokens=False))

    async def __call__(self, key: RequestKey, prompt: Prompt, prompt_ids: tuple[int, ...],
                       sampling: SamplingConfig) -> FinishedEpisode:
        """One episode: its environment made (and given the tokenizer, when it takes one:
        ``attach``) and reset off the loop; then a turn on the engine, the environment's
        answer off the loop, its reply appended, until it ends (module docstring)."""
        env = self.factory()
        attach = getattr(env, "attach", None)
        if callable(attach):
            attach(self._tokenizer)
        episode = Episode(key, prompt, prompt_ids, env, sampling)
        reply: EnvReply | None = await self._ask(episode, env.reset, prompt, reset=True)
        while reply is None or not (reply.done or episode.turns >= self.cfg.max_turns):
            if reply is not None:
                episode.add_reply(self._reply_ids(episode, reply))
            room = self._max_len - len(episode.prompt_ids) - len(episode.tokens)
            if room <= 0:
                episode.finish = episode.ended = "length"
                return episode.finished()
            seq = await Generate(episode.key.at_turn(episode.turns).to_id(), episode.prompt_ids + tuple(episode.tokens),
                                 replace(episode.sampling, max_new_tokens=min(episode.sampling.max_new_tokens, room)))
            episode.add_turn(seq)
            reply = await self._ask(episode, env.step, seq.text, reset=False)
        if episode.failed is None:   # the environment ended it, or the turn cap did
            episode.finish = "stop" if reply.done else "turns"
            episode.ended = "done" if reply.done else "turns"
        episode.reward = reply.reward
        return episode.finished()

    def _reply_ids(self, episode: Episode, reply: EnvReply) -> list[int]:
        """The reply's token ids: its own, its messages as the chat template continues the
        conversation after the model's last token, or its text encoded once."""
        if reply.token_ids is not None:
            return list(reply.token_ids)
        chat = self._chat if reply.messages is not None else None
        if reply.messages is not None and chat is not None:
            return chat.reply_ids(reply.messages, episode.tokens[-1] if episode.tokens else None)
        text = "".join(m.content for m in reply.messages) if reply.messages is not None else reply.text
        return self._engine.encode(text, add_special_tokens=False)

    def _ask(self, episode: Episode, fn: Callable[[Any], Any], arg: Any, *, reset: bool) -> OffLoop:
        """``fn(arg)`` off the loop; the wait's result is its reply (None after ``reset``), read
        on the calls' thread: a failure there is reported at once and ends the episode."""

        def begin(resume: Callable[[Any], None]) -> None:
            self._calls.call(fn, arg, lambda out: resume(self._read(episode, out, reset)))

        return OffLoop(begin)

    def _read(self, episode: Episode, out: Outcome, reset: bool) -> EnvReply | None:
        """What the environment answered (on the calls' thread)."""
        episode.env_s += out.seconds
        if out.error is not None:
            verb = "timed out" if out.timed_out else "raised"
            return self._fail(episode, f"{verb} on prompt {episode.prompt.prompt_id}: {first_line(out.error)}",
                              timeout=out.timed_out)
        if not reset and not isinstance(out.value, EnvReply):
            return self._fail(episode, f"answered prompt {episode.prompt.prompt_id} with a "
                                       f"{type(out.value).__name__}, not an EnvReply")
        if reset:
            return None
        reply: EnvReply = out.value
        episode.tool_calls += reply.tool_calls
        episode.tool_errors += reply.tool_errors
        return reply

    def _fail(self, episode: Episode, what: str, *, timeout: bool = False) -> EnvReply:
        """The episode ends with reward 0; the failure is reported (one line)."""
        episode.failed = f"environment {self.env_name} {what}"
        episode.finish = "abort"
        episode.ended = "timeout" if timeout else "env_error"
        self._failed(episode.failed, timeout)
        return EnvReply(reward=0.0, done=True)

    def close(self) -> None:
        self._calls.close()
