"""Agents as rollouts (``--task.agent MODULE:FUNCTION``, ``pipeline_rl.tasks.agent``): a group
is ``n`` calls of the agent on one prompt, each an *episode* whose every request to the
worker's endpoint (``rollout/agents/endpoint.py``) is generated on the worker's own engine and
recorded, token in, token out (``rollout/agents/agent_tokens.py``).

How a request travels: the endpoint's thread renders its prompt ids and queues one
``GenRequest`` per answer (``KEY#aK.I``: episode ``KEY``, its request ``K``, answer ``I``);
the engine loop adds them at its next pass (:meth:`AgentRollout.pump`), so they share the
engine, the admission budget (a group is admitted before its agents start) and the weight
updates with every other sequence; each finished answer (:meth:`AgentRollout.collect`) goes
back to the waiting request. The answers' ids, log-probs and versions are recorded against
the episode; when the agent returns, its samples (one for a chat loop, one more per
divergence: ``samples_split``) get its reward.

An agent's episode is a :class:`~pipeline_rl.rollout.rollout_shape.Rollout`, as every
rollout is: ``await rollout(key, prompt, prompt_ids, sampling)`` starts the agent's call in the agents' process and
awaits its end off the loop (an ``OffLoop`` the driver, ``rollout/rollout_driver.py``,
resumes); the finished episode holds its samples whole (each with its own prompt: the
group's prompt is the prefix they share, cut by ``rollout_shape.group_samples``). The
endpoint's requests are the rollout's side requests (``SideRequests``), pumped and collected
by the same driver.

The agent calls run in the worker's agents' process (``rollout/agents/agent_host.py``), not in the
worker: their ``openai`` clients' Python and the agent's own code run on another core than the
engine's, and an agent that burns CPU or holds the GIL cannot slow generation. There they run
through the shared ``rollout.bounded_calls`` helper, like environments (``async def`` ones on
the host's event loop, plain ones on its threads), each bounded by ``--task.env_timeout_s``;
the worker ends an episode its host has not answered :data:`HOST_GRACE_S` past that timeout
itself (a host too stuck to answer), and ends the run with one line when the host exits. An
agent call lasts its whole episode, waiting for the engine as much as thinking, so it is
given ``--task.env_concurrency`` slots (agents thinking, as environment calls) plus
``--rollout.max_num_seqs`` (agents waiting for their answers): the worker's admission counts
up to ``env_concurrency`` episodes off the engine beside a full engine. The endpoint serves on
an event loop of its own in the worker. An agent that raises, times out or returns no reward ends its
episode with reward 0 (its samples kept, finish ``abort``), counted as an environment's
failure (``env_errors`` / ``env_timeouts``; ``--task.env_errors fail``; an agent failing on
all of its first episodes ends the run with one line). Answers that finish after their
episode ended are dropped.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from pipeline_rl.calls import LoopThread, first_line
from pipeline_rl.config import Config
from pipeline_rl.rollout.agents.agent_tokens import Answer, Call, episode_samples, render_ids, text_prompt_ids
from pipeline_rl.rollout.agents.agent_host import AgentHost, EpisodeEnded, HostSetup, host_cpus
from pipeline_rl.rollout.chat_turns import ChatTurns
from pipeline_rl.rollout.agents.endpoint import Endpoint, UnknownEpisode
from pipeline_rl.rollout.engines.engine import FinishedSequence, GenerationEngine, GenRequest, SamplingConfig
from pipeline_rl.rollout.request_key import RequestKey
from pipeline_rl.rollout.rollout_shape import EpisodeEnd, FinishedEpisode, OffLoop, Trace
from pipeline_rl.rollout.agents.vllm_tools import ChatCall, Choice, RequestError, TextCall, chat_response, text_response
from pipeline_rl.tasks.tool_calls import ToolCallParser
from pipeline_rl.rollout.worker_stats import AgentMetric, Counters
from pipeline_rl.tasks.base import Prompt

#: The model name ``/v1/models`` lists (requests may name any).
SERVED_NAME = "policy"
#: The agents' own metrics (a dict reward's numbers) kept per name: the latest episodes'.
METRICS_KEPT = 1024
#: Seconds past ``--task.env_timeout_s`` the worker waits for its agents' process to end an
#: episode before ending it itself (the host bounds each call; this bounds the host).
HOST_GRACE_S = 5.0


@dataclass(slots=True, eq=False)
class AgentEpisode:
    """One agent call in flight (``key``: its episode's; ``key.to_id()`` names it to the
    endpoint and the agents' process). ``calls`` and ``answers`` grow on the endpoint's thread
    under the runner's lock, until ``closed`` (then nothing more is recorded)."""

    key: RequestKey
    prompt: Prompt
    sampling: SamplingConfig | None = None   # an evaluation's: it wins over the requests'
    calls: list[Call] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    requests: int = 0
    tool_calls: int = 0
    closed: bool = False


class AgentRollout:
    """Runs a worker's agents (module docstring): ``await rollout(key, prompt, prompt_ids,
    sampling)`` is one agent call's episode (a group's copy, or an evaluation's: then under the evaluation's sampling); the
    engine loop's driver calls :meth:`pump` and :meth:`collect` and reads :attr:`in_engine`;
    the endpoint calls :meth:`chat` and :meth:`complete` on its own thread. ``failed(line,
    timeout)`` reports an agent's failure; ``counters`` (under ``lock``) count refused
    requests. ``agent``: the ``MODULE:FUNCTION`` spec, imported in the agents' process only."""

    def __init__(self, cfg: Config, agent: str, engine: GenerationEngine, name: str, key: str,
                 wake: Callable[[], None], failed: Callable[[str, bool], None], counters: Counters,
                 lock: threading.Lock, fail: Callable[[BaseException], None]) -> None:
        self.served_name, self.max_model_len = SERVED_NAME, cfg.rollout.max_model_len
        self._cfg, self._agent, self._engine, self._wake = cfg, agent, engine, wake
        self._failed, self._c, self._clock = failed, counters, lock
        self._key = key   # the run's endpoint token (run_key.endpoint_token)
        self._lock = threading.Lock()
        self._live: dict[str, AgentEpisode] = {}   # by the episode's id (RequestKey.to_id)
        self._resumes: dict[str, Callable[[EpisodeEnded], None]] = {}   # each live episode's end
        self._inbox: deque[GenRequest] = deque()
        self._deadlines: deque[tuple[float, str]] = deque()   # (when, episode) in start order
        self._timeout_s = cfg.task.env_timeout_s
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[FinishedSequence]]] = {}
        self._chats: dict[str, ChatTurns] = {}
        self._in_engine = 0      # answers queued or generating
        self.requests = 0        # requests served
        self.metrics: dict[str, deque[float]] = {}   # the agents' own metrics (dict rewards), the latest
        self._loops = LoopThread(f"endpoint-{name}")
        self.endpoint = Endpoint(self, self._key, name, self._loops, self._refused)
        self.endpoint.start()
        self._host = AgentHost(HostSetup(agent, self._key, cfg.task.env_timeout_s,
                                         cfg.task.env_concurrency + cfg.rollout.max_num_seqs, tuple(sys.path), name,
                                         host_cpus()),
                               self._host_ended, fail)

    @property
    def host_pid(self) -> int:
        """The process id of this worker's agents' process."""
        return self._host.pid

    # -- the engine loop ----------------------------------------------------------------------
    @property
    def in_engine(self) -> int:
        """Answers the endpoint asked for, queued or generating."""
        return self._in_engine

    def prompt_ids(self, prompt: Prompt) -> None:
        """An agent renders its own prompts: the group's prompt ids come from its samples."""
        return None

    async def __call__(self, key: RequestKey, prompt: Prompt, prompt_ids: tuple[int, ...],
                       sampling: SamplingConfig) -> FinishedEpisode:
        """One agent call: episode ``key`` (a group's completion, or an evaluation's) of
        ``prompt``, started in the agents' process; its end awaited off the loop (the agent
        renders its own prompts: ``prompt_ids`` unused; ``sampling`` is an evaluation's only)."""
        episode, name = AgentEpisode(key, prompt, sampling if key.evaluation else None), key.to_id()
        with self._lock:
            self._live[name] = episode
        self._deadlines.append((time.monotonic() + self._timeout_s + HOST_GRACE_S, name))
        out: EpisodeEnded = await OffLoop(lambda resume: self._begin(name, prompt, resume))
        return self._end(episode, out)

    def _begin(self, name: str, prompt: Prompt, resume: Callable[[EpisodeEnded], None]) -> None:
        with self._lock:
            self._resumes[name] = resume
        self._host.start(name, prompt, self.endpoint.base_url(name))

    def _ends(self, out: EpisodeEnded) -> None:
        """Episode ``out.key`` ended (the first end of a live episode counts)."""
        with self._lock:
            resume = self._resumes.pop(out.key, None)
        if resume is not None:
            resume(out)

    def pump(self) -> None:
        """Add the answers the endpoint asked for; end the episodes the host never answered."""
        with self._lock:
            adds = list(self._inbox)
            self._inbox.clear()
        for request in adds:
            try:
                self._engine.add(request)
            except Exception as e:  # noqa: BLE001 -- vLLM refused the request: the client is told (400)
                self._refuse(request.request_id, RequestError(f"the engine refused the request: {first_line(e)}"))
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:   # the host never answered
            key = self._deadlines.popleft()[1]
            self._ends(EpisodeEnded(key, error=f"TimeoutError: the agents' process gave no end within "
                                    f"{self._timeout_s + HOST_GRACE_S:g} s (--task.env_timeout_s)", timed_out=True,
                                    seconds=self._timeout_s + HOST_GRACE_S))

    def _refuse(self, request_id: str, error: Exception) -> None:
        with self._lock:
            self._in_engine -= 1
            waiter = self._waiters.pop(request_id, None)
        if waiter is not None:
            loop, fut = waiter
            loop.call_soon_threadsafe(_reject, fut, error)

    def collect(self, seq: FinishedSequence, key: RequestKey) -> None:
        """A finished answer (``key``: its request's): back to the request waiting for it
        (dropped when none is)."""
        with self._lock:
            self._in_engine -= 1
            waiter = self._waiters.pop(seq.request_id, None)
        if waiter is not None:
            loop, fut = waiter
            loop.call_soon_threadsafe(_resolve, fut, seq)

    def _end(self, episode: AgentEpisode, out: EpisodeEnded) -> FinishedEpisode:
        with self._lock:
            episode.closed = True
            del self._live[episode.key.to_id()]
            calls = list(episode.calls)
        ended: Literal["done", "env_error", "timeout"] = "done"
        for k, v in out.metrics.items():
            self.metrics.setdefault(k, deque(maxlen=METRICS_KEPT)).append(v)
        if out.error is not None:   # the agent's failure: counted, the episode scored 0
            verb = "timed out" if out.timed_out else ("raised" if out.raised else "")
            ended = "timeout" if out.timed_out else "env_error"
            self._failed(f"agent {self._agent} {verb + ' ' if verb else ''}on prompt "
                         f"{episode.prompt.prompt_id}: {out.error}", out.timed_out)
        end = EpisodeEnd(ended, len(calls), out.seconds, episode.tool_calls, 0,
                         tuple(AgentMetric(k, v) for k, v in out.metrics.items()))
        answers = [a for c in calls for a in c.answers]
        text = "".join(a.text for a in answers)
        if episode.sampling is not None:   # an evaluation's: its answers, in order, and reward
            trace = Trace(np.array([t for a in answers for t in a.token_ids], np.int32),
                          np.array([p for a in answers for p in a.logprobs], np.float32),
                          np.array([v for a in answers for v in a.versions], np.int32), "stop")
            return FinishedEpisode(episode.key, (trace,), text, out.reward, end=end)
        traces = []
        for s in episode_samples(calls):
            traces.append(Trace(np.array(s.tokens, np.int32), np.array(s.logprobs, np.float32),
                                np.array(s.versions, np.int32), "abort" if ended != "done" else s.finish,
                                np.array(s.mask, np.uint8)))
        return FinishedEpisode(episode.key, tuple(traces), text, out.reward, end=end, whole=True)

    def _refused(self) -> None:
        with self._clock:
            self._c.endpoint_refused += 1

    # -- the agents' process (its reader thread) ---------------------------------------------------
    def _host_ended(self, out: EpisodeEnded) -> None:
        self._ends(out)

    # -- the endpoint's thread ------------------------------------------------------------------
    def _episode(self, key: str) -> AgentEpisode:
        with self._lock:
            episode = self._live.get(key)
        if episode is None:
            raise UnknownEpisode(f"no episode {key!r} is running on this worker")
        return episode

    async def chat(self, key: str, call: ChatCall) -> str:
        episode = self._episode(key)
        chat = self._chat_turns(call.tools)
        with self._lock:
            answers = list(episode.answers)
        prompt_ids = render_ids(chat, lambda t: self._engine.encode(t, add_special_tokens=False),
                                call.messages, answers)
        seqs = await self._generate(episode, prompt_ids, call.n, call.max_tokens, call.temperature, call.top_p,
                                    call.seed)
        parser = (ToolCallParser(self._host.tool_parser, self._engine.tokenizer, call.tools)
                  if call.tools and call.parse_tools else None)
        choices = [self._choice(seq, parser, call.logprobs) for seq in seqs]
        self._record(episode, prompt_ids, seqs, choices)
        return chat_response(call.model, prompt_ids, choices, call.logprobs)

    async def complete(self, key: str, call: TextCall) -> str:
        episode = self._episode(key)
        if isinstance(call.prompt, tuple):
            prompt_ids = call.prompt
        else:
            with self._lock:
                calls = list(episode.calls)
            prompt_ids = text_prompt_ids(call.prompt, calls, lambda t, special: self._engine.encode(t, special))
        seqs = await self._generate(episode, prompt_ids, call.n, call.max_tokens, call.temperature, call.top_p,
                                    call.seed)
        choices = [self._choice(seq, None, call.logprobs) for seq in seqs]
        self._record(episode, prompt_ids, seqs, choices, call.prompt if isinstance(call.prompt, str) else None)
        return text_response(call.model, prompt_ids, choices, call.logprobs)

    def _chat_turns(self, tools: tuple[dict[str, Any], ...] | None) -> ChatTurns:
        """The chat template's renderer for these tools (kept per tool set, a few at most)."""
        import json

        sig = json.dumps(tools, sort_keys=True) if tools else ""
        chat = self._chats.get(sig)
        if chat is None:
            if len(self._chats) >= 16:
                self._chats.clear()
            chat = self._chats[sig] = ChatTurns(self._engine.tokenizer, list(tools) if tools else None)
        return chat

    async def _generate(self, episode: AgentEpisode, prompt_ids: tuple[int, ...], n: int, max_tokens: int | None,
                        temperature: float | None, top_p: float | None, seed: int | None) -> list[FinishedSequence]:
        room = self.max_model_len - len(prompt_ids)
        if room <= 0:
            raise RequestError(f"the prompt's {len(prompt_ids)} tokens fill the context "
                               f"(--rollout.max_model_len {self.max_model_len})")
        r, forced = self._cfg.rollout, episode.sampling
        sampling = SamplingConfig(max_new_tokens=min(max_tokens or r.max_new_tokens, room),
                                  temperature=r.temperature if temperature is None else temperature,
                                  top_p=r.top_p if top_p is None else top_p, top_k=r.top_k, seed=seed)
        if forced is not None:
            sampling = replace(forced, max_new_tokens=min(max_tokens or forced.max_new_tokens, room))
        loop = asyncio.get_running_loop()
        futures: dict[str, asyncio.Future[FinishedSequence]] = {}
        with self._lock:
            if episode.closed:
                raise UnknownEpisode(f"episode {episode.key.to_id()!r} has ended")
            k, episode.requests = episode.requests, episode.requests + 1
            for i in range(n):
                rid = episode.key.agent_answer(k, i).to_id()
                futures[rid] = loop.create_future()
                self._waiters[rid] = (loop, futures[rid])
                self._inbox.append(GenRequest(rid, prompt_ids, sampling))
            self._in_engine += n
        self._wake()
        try:
            return list(await asyncio.gather(*futures.values()))
        finally:   # cancelled (the agent gave up): its answers are dropped when they finish
            with self._lock:
                for rid in futures:
                    self._waiters.pop(rid, None)

    def _choice(self, seq: FinishedSequence, parser: ToolCallParser | None, logprobs: bool) -> Choice:
        """``seq`` as an answer (its tokens' names only when the request asked for log-probs)."""
        ids = tuple(seq.token_ids.tolist())
        tok = self._engine.tokenizer
        text = tok.decode(list(ids), skip_special_tokens=True)
        turn = parser.parse(seq.text) if parser is not None else None
        calls = turn.calls if turn is not None else ()
        finish = "length" if seq.finish_reason == "length" else "stop"
        tokens = tuple(t if isinstance(t, str) else f"token_id:{i}"   # an id past the tokenizer's, as vLLM names it
                       for i, t in zip(ids, tok.convert_ids_to_tokens(list(ids)))) if logprobs else ()
        return Choice(text, ids, tuple(seq.logprobs.tolist()), tokens, finish, calls,
                      turn.content if turn is not None and calls else None)

    def _record(self, episode: AgentEpisode, prompt_ids: tuple[int, ...], seqs: list[FinishedSequence],
                choices: list[Choice], prompt_text: str | None = None) -> None:
        answers = tuple(Answer(c.token_ids, c.logprobs, tuple(s.versions.tolist()), s.finish_reason, c.text,
                               c.calls, c.content) for s, c in zip(seqs, choices))
        with self._lock:
            self.requests += 1
            if episode.closed:
                return
            episode.calls.append(Call(prompt_ids, answers, prompt_text))
            episode.answers += answers
            episode.tool_calls += sum(len(c.calls) for c in choices)

    def close(self) -> None:
        """Stop the agents' process and the endpoint (the groups not sent stay the worker's pending)."""
        self._host.close()
        self.endpoint.close()
        self._loops.close()


def _resolve(fut: asyncio.Future[FinishedSequence], seq: FinishedSequence) -> None:
    if not fut.done():
        fut.set_result(seq)


def _reject(fut: asyncio.Future[FinishedSequence], error: Exception) -> None:
    if not fut.done():
        fut.set_exception(error)
