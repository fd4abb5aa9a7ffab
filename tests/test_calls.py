"""The call helpers every process uses (``pipeline_rl/calls.py``)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pipeline_rl.calls import LoopThread, first_line, in_daemon_thread


def test_loop_thread_runs_jobs_and_close_cancels_what_still_waits() -> None:
    loops = LoopThread("test-loop")
    assert loops.submit(asyncio.sleep(0, result=7)).result(timeout=5) == 7
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    waiting = loops.submit(forever())
    loops.close()
    assert cancelled.is_set() and waiting.cancelled() and loops.closed
    loops.close()   # twice is safe
    job = asyncio.sleep(0)
    with pytest.raises(RuntimeError):
        loops.submit(job)
    job.close()


def test_in_daemon_thread_hands_over_result_and_error() -> None:
    assert in_daemon_thread(lambda x: x + 1, 1).result(timeout=5) == 2

    def boom() -> None:
        raise ValueError("bad\nsecond line")

    err = in_daemon_thread(boom).exception(timeout=5)
    assert err is not None and first_line(err) == "ValueError: bad"
