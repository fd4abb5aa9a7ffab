"""Agents as rollouts (``--task.agent MODULE:FUNCTION``, ``pipeline_rl.tasks.agent``): a group
is ``n`` calls of the agent on one prompt, each an *episode* whose every request to the
worker's endpoint (``rollout/endpoint.py``) is generated on the worker's own engine and
recorded, token in, token out (``rollout/agent_tokens.py``).

How a request travels: the endpoint's thread renders its prompt ids and queues one
``GenRequest`` per answer (``KEY#aK.I``: episode ``KEY``, its request ``K``, answer ``I``);
the engine loop adds them at its next pass (:meth:`AgentRunner.pump`), so they share the
engine, the admission budget (a group is admitted before its agents start) and the weight
updates with every other sequence; each finished answer (:meth:`AgentRunner.collect`) goes
back to the waiting request. The answers' ids, log-probs and versions are recorded against
the episode; when the agent returns, its samples (one for a chat loop, one more per
divergence: ``samples_split``) get its reward.

The agent calls run off the engine loop through the shared ``rollout.bounded_calls`` helper,
like environments: ``async def`` ones on an event loop of their own, which also serves the
endpoint (a request and its answer cross no thread but the engine's; their ``openai`` client
speaks HTTP through openai's aiohttp transport, the endpoint's own library), plain ones on
threads, each bounded by ``--task.env_timeout_s`` (a hung one frees its slot at its timeout).
An agent call lasts its whole episode, waiting for the engine as much as thinking, so it is
given ``--task.env_concurrency`` slots (agents thinking, as environment calls) plus
``--rollout.max_num_seqs`` (agents waiting for their answers): the worker's admission counts
up to ``env_concurrency`` episodes off the engine beside a full engine, and with only
``env_concurrency`` slots the engine ran short of sequences while agents thought. An agent that raises, times out or returns no reward ends its
episode with reward 0 (its samples kept, finish ``abort``), counted as an environment's
failure (``env_errors`` / ``env_timeouts``; ``--task.env_errors fail``; an agent failing on
all of its first episodes ends the run with one line). Answers that finish after their
episode ended are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pipeline_rl.calls import LoopThread, first_line
from pipeline_rl.evaluation import EVAL_PREFIX
from pipeline_rl.config import Config
from pipeline_rl.rollout.agent_tokens import (Answer, Call, Sample, episode_samples, group_completions, render_ids,
                                              text_prompt_ids)
from pipeline_rl.rollout.bounded_calls import BoundedCalls, Outcome
from pipeline_rl.rollout.chat_turns import ChatTurns
from pipeline_rl.rollout.endpoint import Endpoint, UnknownEpisode
from pipeline_rl.rollout.engine import FinishedSequence, GenerationEngine, GenRequest, SamplingConfig
from pipeline_rl.rollout.scoring import PendingGroup, Scorer
from pipeline_rl.rollout.vllm_tools import (ChatCall, Choice, RequestError, TextCall, ToolCallParser,
                                            chat_response, text_response)
from pipeline_rl.rollout.worker_stats import AgentMetric, Counters
from pipeline_rl.tasks.agent import AgentSpec, agent_reward
from pipeline_rl.tasks.base import Prompt

#: The model name ``/v1/models`` lists (requests may name any).
SERVED_NAME = "policy"
#: The agents' own metrics (a dict reward's numbers) kept per name: the latest episodes'.
METRICS_KEPT = 1024


@dataclass(slots=True, eq=False)
class AgentEpisode:
    """One agent call in flight. ``calls`` and ``answers`` grow on the endpoint's thread
    under the runner's lock, until ``closed`` (then nothing more is recorded)."""

    key: str
    prompt: Prompt
    sampling: SamplingConfig | None = None   # an evaluation's: it wins over the requests'
    calls: list[Call] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    requests: int = 0
    tool_calls: int = 0
    closed: bool = False


@dataclass(slots=True)
class AgentGroup:
    """A group's episodes as they end: their samples and reward, by index."""

    prompt: Prompt
    n: int
    ended: dict[int, tuple[list[Sample], float]] = field(default_factory=dict)


class AgentRunner:
    """Runs a worker's agents (module docstring), in the worker as its episode driver is: the
    engine loop calls :meth:`start`, :meth:`pump`, :meth:`collect` and reads :attr:`waiting`;
    the endpoint calls :meth:`chat` and :meth:`complete` on its own thread. A group is the
    worker's ``pending`` entry until sent (then removed); ``release(k)``: give ``k`` admitted
    groups back (a group none of whose agents made a request has nothing to send). An
    evaluation's episode (its key ``EVAL_PREFIX...``) runs the agent too, under the
    evaluation's sampling; ``answered(key, text, versions, reward)`` takes its end."""

    def __init__(self, cfg: Config, agent: AgentSpec, engine: GenerationEngine, name: str, key: str | None,
                 wake: Callable[[], None], scorer: Scorer, counters: Counters, lock: threading.Lock,
                 pending: dict[int, PendingGroup], release: Callable[[int], object],
                 answered: Callable[[str, str, np.ndarray, float | None], None]) -> None:
        self.served_name, self.max_model_len = SERVED_NAME, cfg.rollout.max_model_len
        self._cfg, self._agent, self._engine, self._wake = cfg, agent, engine, wake
        self._scorer, self._c, self._clock, self._release = scorer, counters, lock, release
        self._pending, self.n, self._answered = pending, cfg.rollout.n, answered
        self._key = key or secrets.token_urlsafe(32)   # a worker of its own (tests): a key of its own
        self._lock = threading.Lock()
        self._live: dict[str, AgentEpisode] = {}
        self._groups: dict[int, AgentGroup] = {}
        self._inbox: deque[GenRequest] = deque()
        self._ended: deque[tuple[AgentEpisode, Outcome]] = deque()
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[FinishedSequence]]] = {}
        self._chats: dict[str, ChatTurns] = {}
        self._clients: dict[bool, Any] = {}   # the agents' openai clients (sync: True), made at first use
        self.in_engine = 0       # answers queued or generating
        self.requests = 0        # requests served
        self.samples_split = 0   # samples beyond one per episode (an agent rewrote its history)
        self.samples_dropped = 0  # samples sharing no first token with their group's
        self.metrics: dict[str, deque[float]] = {}   # the agents' own metrics (dict rewards), the latest
        self._calls = BoundedCalls(cfg.task.env_concurrency + cfg.rollout.max_num_seqs, cfg.task.env_timeout_s,
                                   f"agent-{name}",
                                   "--task.env_timeout_s")
        self._loops = LoopThread(f"agents-{name}")
        self.endpoint = Endpoint(self, self._key, name, self._loops, self._refused)
        self.endpoint.start()

    # -- the engine loop ----------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Episodes running with no answer in the engine (their agent is thinking)."""
        with self._lock:
            return max(0, len(self._live) - self.in_engine)

    def prompt_ids(self, prompt: Prompt) -> None:
        """An agent renders its own prompts: the group's prompt ids come from its samples."""
        return None

    def start(self, key: str, prompt: Prompt, prompt_ids: tuple[int, ...], sampling: SamplingConfig) -> None:
        """Start an agent call: episode ``key`` (``GROUP:INDEX``, or an evaluation's) of ``prompt``
        (the agent renders its own prompts: ``prompt_ids`` unused; ``sampling`` is an evaluation's only)."""
        evaluation = key.startswith(EVAL_PREFIX)
        gid = -1 if evaluation else int(key.split(":")[0])
        if not evaluation and gid not in self._groups:
            self._groups[gid] = AgentGroup(prompt, self.n)
        episode = AgentEpisode(key, prompt, sampling if evaluation else None)
        with self._lock:
            self._live[key] = episode
        self._loops.submit(self._run(episode))

    def pump(self) -> None:
        """Add the answers the endpoint asked for; end the episodes whose agent returned."""
        with self._lock:
            adds, ended = list(self._inbox), list(self._ended)
            self._inbox.clear()
            self._ended.clear()
        for request in adds:
            try:
                self._engine.add(request)
            except Exception as e:  # noqa: BLE001 -- vLLM refused the request: the client is told (400)
                self._refuse(request.request_id, RequestError(f"the engine refused the request: {first_line(e)}"))
        for episode, out in ended:
            self._end(episode, out)

    def _refuse(self, request_id: str, error: Exception) -> None:
        with self._lock:
            self.in_engine -= 1
            waiter = self._waiters.pop(request_id, None)
        if waiter is not None:
            loop, fut = waiter
            loop.call_soon_threadsafe(_reject, fut, error)

    def collect(self, seq: FinishedSequence) -> None:
        """A finished answer: back to the request waiting for it (dropped when none is)."""
        with self._lock:
            self.in_engine -= 1
            waiter = self._waiters.pop(seq.request_id, None)
        if waiter is not None:
            loop, fut = waiter
            loop.call_soon_threadsafe(_resolve, fut, seq)

    def _end(self, episode: AgentEpisode, out: Outcome) -> None:
        with self._lock:
            episode.closed = True
            del self._live[episode.key]
            calls = list(episode.calls)
        ended, reward = "done", 0.0
        metrics: dict[str, float] = {}
        try:
            if out.error is not None:
                raise out.error
            reward, metrics = agent_reward(out.value)
            for k, v in metrics.items():
                self.metrics.setdefault(k, deque(maxlen=METRICS_KEPT)).append(v)
        except Exception as e:  # noqa: BLE001 -- the agent's failure: counted, the episode scored 0
            verb = "timed out" if out.timed_out else ("raised" if out.error is not None else "")
            ended = "timeout" if out.timed_out else "env_error"
            self._scorer.failure(f"agent {self._agent.name} {verb + ' ' if verb else ''}on prompt "
                                 f"{episode.prompt.prompt_id}: {first_line(e)}", env=True, timeout=out.timed_out)
        with self._clock:
            self._c.episode_ended(ended, len(calls), out.seconds, episode.tool_calls, 0,
                                  tuple(AgentMetric(k, v) for k, v in metrics.items()))
        if episode.sampling is not None:   # an evaluation's: its answers and reward
            answers = [a for c in calls for a in c.answers]
            self._answered(episode.key, "".join(a.text for a in answers),
                           np.array([v for a in answers for v in a.versions], np.int32), reward)
            return
        samples = episode_samples(calls)
        for s in samples:
            s.finish = "abort" if ended != "done" else s.finish
        gid, idx = (int(x) for x in episode.key.split(":"))
        group = self._groups[gid]
        group.ended[idx] = (samples, reward)
        if len(group.ended) == group.n:
            del self._groups[gid]
            self._send(gid, group)

    def _send(self, group_id: int, group: AgentGroup) -> None:
        pairs = [(s, r) for i in range(group.n) for samples, r in [group.ended[i]] for s in samples]
        prompt_ids, completions = group_completions(pairs)
        split = sum(max(0, len(s) - 1) for s, _ in group.ended.values())
        self.samples_split += split
        with self._clock:
            self._c.samples_split += split
        self.samples_dropped += len(pairs) - len(completions)
        pending = self._pending.pop(group_id)
        if not completions:
            self._release(1)
            return
        self._scorer.send_scored(replace(pending, prompt_ids=prompt_ids), completions)

    def _refused(self) -> None:
        with self._clock:
            self._c.endpoint_refused += 1

    # -- the agent calls (their own loop, or threads) -------------------------------------------
    async def _run(self, episode: AgentEpisode) -> None:
        call = self._call_async if self._agent.is_async else self._call_sync
        out = await self._calls.run(call, episode)
        with self._lock:
            self._ended.append((episode, out))
        self._wake()

    def _client(self, episode: AgentEpisode, sync: bool) -> Any:
        """An episode's client: a copy of the runner's one, pointed at the episode (the copies
        share its connection pool: no connection, TLS context or pool made per episode)."""
        import openai

        with self._lock:
            base = self._clients.get(sync)
            if base is None:
                url, timeout = self.endpoint.base_url("-"), self._cfg.task.env_timeout_s
                base = self._clients[sync] = (
                    openai.OpenAI(base_url=url, api_key=self._key, max_retries=0, timeout=timeout) if sync else
                    openai.AsyncOpenAI(base_url=url, api_key=self._key, max_retries=0, timeout=timeout,
                                       http_client=_async_http()))
        return base.with_options(base_url=self.endpoint.base_url(episode.key))

    async def _call_async(self, episode: AgentEpisode) -> Any:
        return await self._agent.fn(self._client(episode, sync=False), episode.prompt)

    def _call_sync(self, episode: AgentEpisode) -> Any:
        return self._agent.fn(self._client(episode, sync=True), episode.prompt)

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
        parser = (ToolCallParser(self._agent.tool_parser, self._engine.tokenizer, call.tools)
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
                raise UnknownEpisode(f"episode {episode.key!r} has ended")
            k, episode.requests = episode.requests, episode.requests + 1
            for i in range(n):
                rid = f"{episode.key}#a{k}.{i}"
                futures[rid] = loop.create_future()
                self._waiters[rid] = (loop, futures[rid])
                self._inbox.append(GenRequest(rid, prompt_ids, sampling))
            self.in_engine += n
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
        """Stop the endpoint and the agent calls (the groups not sent stay the worker's pending)."""
        self.endpoint.close()
        client = self._clients.pop(False, None)
        if client is not None and not self._loops.closed:   # closed on the loop it served
            with contextlib.suppress(Exception):
                self._loops.submit(client.close()).result(timeout=LoopThread.CLOSE_WAIT_S)
        self._loops.close()
        self._calls.close()
        sync = self._clients.pop(True, None)
        if sync is not None:
            sync.close()


def _resolve(fut: asyncio.Future[FinishedSequence], seq: FinishedSequence) -> None:
    if not fut.done():
        fut.set_result(seq)


def _reject(fut: asyncio.Future[FinishedSequence], error: Exception) -> None:
    if not fut.done():
        fut.set_exception(error)


def _async_http() -> Any:
    """The async clients' HTTP client: openai's aiohttp-based one (``openai.DefaultAioHttpClient``,
    about a third less CPU per request than its default httpx pool, whose every request probes
    each idle connection), or its default when aiohttp is missing."""
    import openai

    try:
        return openai.DefaultAioHttpClient()
    except RuntimeError:   # openai's stand-in when aiohttp is not installed
        return openai.DefaultAsyncHttpxClient()
