"""The rollout worker's OpenAI-compatible endpoint: ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models``, served on the worker's own engine for the agents of
its episodes (``rollout/agents/runner.py``).

- **Who may call.** It listens on loopback only (the agents run in the worker's own agents'
  process, ``rollout/agents/agent_host.py``, on its node),
  on a port the system picks, and every request must carry the run's key
  (``Authorization: Bearer KEY``, what ``openai.OpenAI(api_key=KEY)`` sends); one without
  it is answered 401 and counted (:attr:`Endpoint.refused`), compared in constant time.
- **Which episode.** An agent's client is pointed at ``/ep/EPISODE/v1``: the path names the
  episode every token of the request is recorded against. ``/v1/...`` without it answers
  ``/v1/models`` only; a request for an episode that is not running is answered 404.
- **What it speaks.** Requests and responses are vLLM's own OpenAI types
  (``rollout/agents/vllm_tools.py``); errors are vLLM's ``ErrorResponse`` bodies. Generation is the
  :class:`Serving` backend's (the agent runner: the worker's engine, its admission budget and
  its weight updates).

The server runs on the event loop it is given (``aiohttp``), off the engine's thread: the agent
runner's, where each request waits for its answers (the loop's owner closes it).
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from pipeline_rl.calls import LoopThread
from pipeline_rl.rollout.agents.vllm_tools import ChatCall, RequestError, TextCall, chat_call, error_body, model_list, text_call

log = logging.getLogger(__name__)

#: The host the endpoint binds: loopback (its clients run in the worker's agents' process).
HOST = "127.0.0.1"


class UnknownEpisode(LookupError):
    """A request names an episode that is not running (404)."""


class Serving(Protocol):
    """What answers the endpoint's requests (``rollout.agents.runner.AgentRollout``)."""

    served_name: str
    max_model_len: int

    async def chat(self, episode: str, call: ChatCall) -> str:
        """A chat request of ``episode``, answered as vLLM's response (JSON text)."""

    async def complete(self, episode: str, call: TextCall) -> str:
        """A completion request of ``episode``, answered as vLLM's response (JSON text)."""


class Endpoint:
    """See the module docstring. :attr:`url` is ``http://127.0.0.1:PORT``;
    :meth:`base_url` is an episode's OpenAI ``base_url``. Start with :meth:`start`."""

    def __init__(self, serving: Serving, key: str, name: str, loops: LoopThread,
                 refused: Callable[[], None] | None = None) -> None:
        """``loops``: the event loop to serve on; ``refused``: told of each request refused for want
        of the key (besides :attr:`refused`)."""
        if not key:
            raise ValueError("the endpoint needs the run's key")
        self._serving, self._key, self._name, self._on_refused = serving, f"Bearer {key}", name, refused
        self._lock = threading.Lock()
        self.refused = 0   # requests without the run's key (answered 401)
        self.url = ""
        self._loops: LoopThread | None = None
        self._given = loops
        self._runner: Any = None

    def base_url(self, episode: str) -> str:
        return f"{self.url}/ep/{episode}/v1"

    def start(self, timeout_s: float = 30.0) -> str:
        """Bind and serve (on a thread of its own); the URL it serves at."""
        self._loops = self._given
        self.url = self._loops.submit(self._start()).result(timeout=timeout_s)
        log.info("endpoint %s: serving at %s", self._name, self.url)
        return self.url

    async def _start(self) -> str:
        from aiohttp import web

        app = web.Application(middlewares=[self._auth], client_max_size=64 * 2**20)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/ep/{episode}/v1/models", self._models)
        app.router.add_post("/ep/{episode}/v1/chat/completions", self._handler(chat_call, self._serving.chat))
        app.router.add_post("/ep/{episode}/v1/completions", self._handler(text_call, self._serving.complete))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, HOST, 0).start()
        host, port = self._runner.addresses[0][:2]
        return f"http://{host}:{port}"

    def _json(self, body: dict[str, Any], status: int = 200) -> Any:
        from aiohttp import web

        return web.json_response(body, status=status)

    def _error(self, status: int, message: str) -> Any:
        return self._json(error_body(message, status), status)

    @property
    def _auth(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def auth(request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), self._key.encode()):
                with self._lock:
                    self.refused += 1
                if self._on_refused is not None:
                    self._on_refused()
                return self._error(401, "this endpoint takes the run's key (Authorization: Bearer KEY)")
            return await handler(request)

        return auth

    async def _models(self, request: Any) -> Any:
        return self._json(model_list(self._serving.served_name, self._serving.max_model_len))

    def _handler(self, parse: Callable[[Any], Any],
                 serve: Callable[[str, Any], Awaitable[str]]) -> Callable[[Any], Awaitable[Any]]:
        from aiohttp import web

        async def handle(request: Any) -> Any:   # JSON bytes in, JSON text out: pydantic's one pass each way
            try:
                body = await request.read()
                text = await serve(request.match_info["episode"], parse(body))
                return web.Response(text=text, content_type="application/json")
            except UnknownEpisode as e:
                return self._error(404, str(e))
            except (RequestError, ValueError) as e:
                return self._error(400, str(e) or type(e).__name__)

        return handle

    def close(self) -> None:
        """Stop serving (the loop's owner cancels what still runs on it as it closes it); safe to
        call twice."""
        if self._loops is None:
            return
        loops, self._loops = self._loops, None
        if self._runner is not None and not loops.closed:
            try:
                loops.submit(self._runner.cleanup()).result(timeout=LoopThread.CLOSE_WAIT_S)
            except Exception as e:  # noqa: BLE001 -- closing: say it, go on
                log.debug("endpoint %s: cleanup: %s", self._name, e)
