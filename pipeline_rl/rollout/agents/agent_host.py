"""The agents' own process: a rollout worker's agent code (``--task.agent``) and its ``openai``
clients run here, beside the worker, never in it (``rollout/agents/runner.py`` keeps the endpoint,
the engine, the admission budget, the token records and the rewards).

Why a process of its own: an agent request costs about as much Python on the client's side
(openai, its HTTP client, asyncio) as on the endpoint's, and agent code may burn CPU or hold
the GIL for as long as it likes; in the engine's process either slows generation directly.
Here it runs on another core.

- **The link.** One socket pair, inherited by the host as a file descriptor (its number is on
  the command line, nothing else is), carrying pickled typed messages, each a 4-byte length
  then its bytes. The worker sends :class:`HostSetup` first (the spec, the run's key, the
  bounds, its ``sys.path``, appended to the host's own, so that agents importable in the worker
  are importable here; ``PYTHONPATH`` names the worker's ``pipeline_rl`` first), then
  :class:`StartEpisode` per episode and :class:`StopHost` at its close; the host answers
  :class:`HostReady` (the agent's tool-call parser, or the error line of a spec that does not
  resolve here: the agent is imported here only, never in the worker), then
  :class:`EpisodeEnded` per episode, the agent's value already read by ``agent_reward``.
- **Bounds.** Each agent call is bounded by ``--task.env_timeout_s`` through
  ``rollout.bounded_calls`` (``async def`` agents on the host's event loop, plain ones on its
  threads); the worker keeps a later deadline of its own for a host too stuck to answer.
- **Cores.** A worker pinned to a core of its own starts its host on the machine's other
  cores (:func:`host_cpus`): on the worker's, the host's Python would take the engine's time.
- **Lifetimes.** The host exits when its end of the pair reads EOF (the worker closed it, or
  died) or when its parent changes (checked every :data:`PARENT_CHECK_S`); the worker ends
  the run with one line when the host exits before it is told to (:class:`AgentHost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline_rl.tasks.agent import DEFAULT_TOOL_PARSER
from pipeline_rl.tasks.base import Prompt

#: How often the host checks that the worker that started it is still its parent.
PARENT_CHECK_S = 1.0
#: How long a closing worker waits for its host to exit before killing it.
EXIT_WAIT_S = 3.0
#: How long the worker's side waits for the host's :class:`HostReady` when asked its parser.
READY_WAIT_S = 5.0
_LEN = struct.Struct("!I")
#: The folder holding this ``pipeline_rl``: the host imports the worker's own copy first.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True, slots=True)
class HostSetup:
    """The worker's first message: what the host runs and how (``key``: the run's secret, the
    clients' ``api_key``; ``sys_path``: the worker's import path, set before the spec resolves)."""

    spec: str
    key: str
    timeout_s: float
    concurrency: int
    sys_path: tuple[str, ...]
    name: str
    cpus: tuple[int, ...] = ()   # the CPUs to run on (empty: the worker's own, inherited)


@dataclass(frozen=True, slots=True)
class StartEpisode:
    """Run the agent once on ``prompt``, its client pointed at ``base_url`` (the episode's)."""

    key: str
    prompt: Prompt
    base_url: str


@dataclass(frozen=True, slots=True)
class StopHost:
    """The worker is closing: exit now (agents still running are dropped)."""


@dataclass(frozen=True, slots=True)
class HostReady:
    """The host's first message: ``error`` is the one line of a spec that would not resolve;
    ``tool_parser``: the resolved agent's (``tasks.agent.AgentSpec.tool_parser``)."""

    error: str | None = None
    tool_parser: str = ""


@dataclass(frozen=True, slots=True)
class EpisodeEnded:
    """How episode ``key``'s agent call ended: ``reward`` and ``metrics`` (``agent_reward``'s
    reading of its value), or ``error`` (one line) when it raised (``raised``), timed out
    (``timed_out``) or returned no reward (neither); ``seconds`` its call lasted."""

    key: str
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    raised: bool = False
    timed_out: bool = False
    seconds: float = 0.0


def frame(message: object) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_message(sock: socket.socket) -> object | None:
    """The next message on a blocking socket; None at EOF."""
    head = _recv_exact(sock, _LEN.size)
    body = None if head is None else _recv_exact(sock, _LEN.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def host_cpus() -> tuple[int, ...]:
    """The CPUs for a worker's agents' process: this machine's but the worker's own when the worker
    is pinned to one core (``actors/process.pin_to_core``; the host must not share the engine's
    core, which is the point of it), else none named (it inherits the worker's)."""
    if not hasattr(os, "sched_getaffinity"):
        return ()
    mine, every = os.sched_getaffinity(0), set(range(os.cpu_count() or 1))
    return tuple(sorted(every - mine)) if len(mine) == 1 and every - mine else ()


class AgentHostDied(RuntimeError):
    """The agents' process exited while the worker still needed it."""


class AgentHost:
    """The worker's side: starts the host process (:meth:`start`), sends it episodes, and hands
    each :class:`EpisodeEnded` to ``ended`` on a reader thread of its own; ``died(error)`` is
    called once if the host exits before :meth:`close` (or cannot resolve the spec)."""

    def __init__(self, setup: HostSetup, ended: Callable[[EpisodeEnded], None],
                 died: Callable[[BaseException], None]) -> None:
        self._setup, self._ended, self._died = setup, ended, died
        self._send_lock = threading.Lock()
        self._closing = False
        self._ready = threading.Event()   # HostReady read (or the host gone)
        self._tool_parser = DEFAULT_TOOL_PARSER
        self._sock, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
        self._proc = subprocess.Popen([sys.executable, "-m", "pipeline_rl.rollout.agents.agent_host", str(theirs.fileno())],
                                      pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self._send(setup)
        self._reader = threading.Thread(target=self._read, name=f"agent-host-{setup.name}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The agents' process's id."""
        return self._proc.pid

    @property
    def tool_parser(self) -> str:
        """The agent's tool-call parser, as the host resolved it. Its requests come after its
        :class:`HostReady`, so this waits only while the reader thread is a message behind."""
        self._ready.wait(READY_WAIT_S)
        return self._tool_parser

    def _send(self, message: object) -> None:
        data = frame(message)
        with self._send_lock:
            self._sock.sendall(data)

    def start(self, key: str, prompt: Prompt, base_url: str) -> None:
        """Start episode ``key``; a host already gone is the reader's to report."""
        try:
            self._send(StartEpisode(key, prompt, base_url))
        except OSError:
            pass

    def _read(self) -> None:
        while True:
            try:
                message = read_message(self._sock)
            except OSError:
                message = None
            if isinstance(message, EpisodeEnded):
                self._ended(message)
            elif isinstance(message, HostReady):
                self._tool_parser = message.tool_parser or DEFAULT_TOOL_PARSER
                self._ready.set()
                if message.error is not None:   # said once; the host exits
                    self._closing = True
                    self._died(AgentHostDied(f"the agents' process of worker {self._setup.name} could not "
                                             f"load the agent: {message.error}"))
            else:   # EOF: the host exited
                self._ready.set()
                break
        if not self._closing:
            code = self._proc.wait()
            self._died(AgentHostDied(f"the agents' process of worker {self._setup.name} exited "
                                     f"(status {code}) while its agents ran"))

    def close(self) -> None:
        """Tell the host to exit, wait a little, kill it if it has not."""
        if self._closing:
            return
        self._closing = True
        try:
            self._send(StopHost())
        except OSError:
            pass
        try:
            self._proc.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._sock.close()


# -- the host process ------------------------------------------------------------------------------
class _Host:
    """The host's agents: one event loop, the openai clients made at first use."""

    def __init__(self, setup: HostSetup, writer: asyncio.StreamWriter) -> None:
        from pipeline_rl.rollout.bounded_calls import BoundedCalls
        from pipeline_rl.tasks.agent import resolve_agent

        self._setup, self._writer = setup, writer
        self._agent = resolve_agent(setup.spec)
        self.tool_parser = self._agent.tool_parser
        self._calls = BoundedCalls(setup.concurrency, setup.timeout_s, f"agent-{setup.name}", "--task.env_timeout_s")
        self._clients: dict[bool, Any] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def start(self, message: StartEpisode) -> None:
        task = asyncio.get_running_loop().create_task(self._run(message))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, message: StartEpisode) -> None:
        from pipeline_rl.calls import first_line
        from pipeline_rl.tasks.agent import agent_reward

        call = self._call_async if self._agent.is_async else self._call_sync
        out = await self._calls.run(call, message)
        raised = out.error is not None and not out.timed_out
        try:
            if out.error is not None:
                raise out.error
            reward, metrics = agent_reward(out.value)
            ended = EpisodeEnded(message.key, reward, metrics, seconds=out.seconds)
        except Exception as e:  # noqa: BLE001 -- the agent's failure, one line for the worker
            ended = EpisodeEnded(message.key, error=first_line(e), raised=raised, timed_out=out.timed_out,
                                 seconds=out.seconds)
        self._writer.write(frame(ended))

    def _client(self, message: StartEpisode, sync: bool) -> Any:
        """An episode's client: a copy of the host's one, pointed at the episode (the copies share
        its connection pool)."""
        import openai

        base = self._clients.get(sync)
        if base is None:
            s = self._setup
            base = self._clients[sync] = (
                openai.OpenAI(base_url=message.base_url, api_key=s.key, max_retries=0, timeout=s.timeout_s) if sync
                else openai.AsyncOpenAI(base_url=message.base_url, api_key=s.key, max_retries=0, timeout=s.timeout_s,
                                        http_client=_async_http()))
        return base.with_options(base_url=message.base_url)

    async def _call_async(self, message: StartEpisode) -> Any:
        return await self._agent.fn(self._client(message, sync=False), message.prompt)

    def _call_sync(self, message: StartEpisode) -> Any:
        return self._agent.fn(self._client(message, sync=True), message.prompt)


def _async_http() -> Any:
    """The async clients' HTTP client: openai's aiohttp-based one (``openai.DefaultAioHttpClient``,
    about a third less CPU per request than its default httpx pool), or its default when
    aiohttp is missing."""
    import openai

    try:
        return openai.DefaultAioHttpClient()
    except RuntimeError:   # openai's stand-in when aiohttp is not installed
        return openai.DefaultAsyncHttpxClient()


async def _read(reader: asyncio.StreamReader) -> object | None:
    try:
        head = await reader.readexactly(_LEN.size)
        return pickle.loads(await reader.readexactly(_LEN.unpack(head)[0]))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


async def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_CHECK_S)
    os._exit(0)


async def _serve(fd: int, parent: int) -> None:
    reader, writer = await asyncio.open_connection(sock=socket.socket(fileno=fd))
    watch = asyncio.create_task(_watch_parent(parent))
    setup = await _read(reader)
    if not isinstance(setup, HostSetup):
        return
    sys.path += [p for p in setup.sys_path if p not in sys.path]   # after the host's own: the stdlib stays first
    if setup.cpus:   # before any thread starts: they inherit it
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, setup.cpus)
    try:
        host = _Host(setup, writer)
    except Exception as e:  # noqa: BLE001 -- said in one line, then this process is done
        from pipeline_rl.calls import first_line

        writer.write(frame(HostReady(first_line(e))))
        await writer.drain()
        return
    writer.write(frame(HostReady(tool_parser=host.tool_parser)))
    while isinstance(message := await _read(reader), StartEpisode):
        host.start(message)
    watch.cancel()


def main(argv: list[str]) -> None:
    """``python -m pipeline_rl.rollout.agents.agent_host FD``: serve the worker on inherited socket ``FD``;
    exit at once (``os._exit``: hung agent threads do not hold it) when the worker is done."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a terminal's Ctrl-C is the worker's to act on
    parent, status = os.getppid(), 0
    try:
        asyncio.run(_serve(int(argv[0]), parent))
    except BaseException as e:  # noqa: BLE001 -- one line, then out
        from pipeline_rl.calls import first_line

        print(f"agent host: {first_line(e)}", file=sys.stderr)
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


if __name__ == "__main__":   # the messages' classes are the module's, not __main__'s
    from pipeline_rl.rollout.agents.agent_host import main as _main

    _main(sys.argv[1:])
