"""A remote reward: ``--task.reward http://HOST:PORT/PATH`` (or ``https://``) scores the
completions of a group with one HTTP request.

The request, one per group (the ``n`` completions of one prompt)::

    POST /PATH   Content-Type: application/json
    [{"prompt": "<the prompt as written>", "completion": "<text>", "answer": "<reference>" or null}, ...]

``prompt`` is the task's prompt before any chat template (``Prompt.question``),
``completion`` the generated text, ``answer`` the reference answer (null when the task
has none). The answer must be a 2xx response whose body is a JSON list of as many
numbers as completions, in the same order (scores in [0, 1])::

    [1.0, 0.0, 0.5, ...]

Connections are kept alive, one per thread calling (the rollout worker calls from a
pool of ``--task.reward_concurrency`` threads). A connection error or a 5xx answer is
retried ``RETRIES`` times with exponential back-off (``BACKOFF_S``, doubling); a 4xx
answer, a socket timeout (``--task.reward_timeout_s``) or a body that is not such a
list is an error at once. A call that still fails raises :class:`RemoteRewardError`
(the worker counts it as a reward error for each completion, scored 0).

At start-up (:meth:`RemoteReward.probe`, called where the task is built: the driver
before any process starts, each rollout worker as it starts) one ``POST`` of ``[]``
must be answered 2xx with a JSON list: a server that is down, a wrong path (404) or a
wrong body is a one-line :class:`TaskError` naming ``task.reward``.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

from pipeline_rl.calls import first_line
from pipeline_rl.tasks.base import Prompt, TaskError

#: ``http(s)://HOST[:PORT][/PATH]``.
REMOTE_SPEC = re.compile(r"^https?://[^\s/?#]+(/\S*)?$")
#: Further attempts after a connection error or a 5xx answer.
RETRIES = 3
#: Wait before the first retry; doubles with each further one.
BACKOFF_S = 0.1
#: The start-up probe waits at most this long (or the reward timeout, if shorter).
PROBE_TIMEOUT_S = 10.0


class RemoteRewardError(RuntimeError):
    """A remote reward call failed (after its retries); one line."""


class _Retry(Exception):
    """One attempt failed in a way worth retrying (connection error, 5xx)."""


class RemoteReward:
    """The remote reward at ``url`` (see the module docstring); thread-safe: each thread
    keeps its own keep-alive connection. Also a per-completion reward (a batch of one)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        parts = urlsplit(url)
        try:
            host, self._port = parts.hostname, parts.port
        except ValueError:   # a port that is not a number in 0-65535
            host = None
        if not REMOTE_SPEC.match(url) or not host:
            raise TaskError(f"task.reward: expected http(s)://HOST:PORT/PATH, got {url!r}")
        self.url, self.timeout_s, self._host = url, timeout_s, host
        self._https = parts.scheme == "https"
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._local = threading.local()

    def __call__(self, prompt: str, completion: str, meta: Prompt) -> float:
        """A batch of one (``Task.reward`` outside a rollout worker, which uses :meth:`score_batch`)."""
        value = self.score_batch(meta, [completion])[0]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise RemoteRewardError(f"the score {value!r} is not a number")
        return float(value)

    def score_batch(self, meta: Prompt, completions: Sequence[str]) -> list[object]:
        """POST the batch (retrying as the module docstring says); one value per completion."""
        answer = meta.answer if meta.answer != "" else None
        body = json.dumps([{"prompt": meta.question, "completion": c, "answer": answer} for c in completions])
        error = ""
        for attempt in range(RETRIES + 1):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                return self._post(body.encode(), len(completions), self.timeout_s)
            except _Retry as e:
                error = str(e)
        raise RemoteRewardError(f"{error} (after {RETRIES + 1} attempts)")

    def probe(self) -> None:
        """One ``POST []`` that must be answered 2xx with a JSON list; else a one-line
        :class:`TaskError` naming ``task.reward``."""
        try:
            self._post(b"[]", None, min(self.timeout_s, PROBE_TIMEOUT_S))
        except (_Retry, RemoteRewardError, OSError) as e:
            why = str(e).splitlines()[0] if isinstance(e, (_Retry, RemoteRewardError)) and str(e) else first_line(e)
            raise TaskError(f"task.reward: the remote reward {self.url} failed its start-up check "
                            f"(POST []): {why}") from None
        finally:
            self._drop()

    def _post(self, body: bytes, expect: int | None, timeout_s: float) -> list[object]:
        """One attempt: the validated list, or :class:`_Retry` / :class:`RemoteRewardError`.
        A socket timeout is raised as it is (``TimeoutError``), never retried."""
        try:
            conn = self._connection(timeout_s)
            conn.request("POST", self._path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        except TimeoutError:
            self._drop()
            raise
        except (OSError, http.client.HTTPException) as e:
            self._drop()
            raise _Retry(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None
        if resp.will_close:
            self._drop()
        if resp.status >= 500:
            raise _Retry(f"HTTP {resp.status} {resp.reason}")
        if not 200 <= resp.status < 300:
            raise RemoteRewardError(f"HTTP {resp.status} {resp.reason}")
        return _scores(data, expect)

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = self._local.conn = kind(self._host, self._port, timeout=timeout_s)
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()


def _scores(data: bytes, expect: int | None) -> list[object]:
    """The JSON list in ``data`` (of ``expect`` values when given), or a one-line error."""
    try:
        values = json.loads(data)
    except ValueError:
        values = None
    if not isinstance(values, list):
        raise RemoteRewardError(f"the answer is not a JSON list: {data[:60]!r}")
    if expect is not None and len(values) != expect:
        raise RemoteRewardError(f"{len(values)} scores for {expect} completions")
    return values
