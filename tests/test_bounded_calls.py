"""The concurrency-with-timeout helper shared by rewards and environments
(``pipeline_rl.rollout.bounded_calls``): a hung plain call frees its slot at its timeout and
its thread is replaced, so hung calls never starve the others; an ``async def`` one is
cancelled; every call ends in one ``Outcome``."""

from __future__ import annotations

import asyncio
import threading
import time

from pipeline_rl.rollout.bounded_calls import BoundedCalls


def test_hung_threads_are_replaced_and_the_other_calls_go_on() -> None:
    release = threading.Event()
    calls = BoundedCalls(2, 0.2, "t", "--x.timeout_s")

    def work(i: int) -> int:
        if i < 4:                # the first four hang (more than the two slots)
            release.wait(30)
        return i

    async def main() -> list:
        return list(await asyncio.gather(*(calls.run(work, i) for i in range(12))))

    start = time.perf_counter()
    try:
        outs = asyncio.run(main())
        took = time.perf_counter() - start
        assert calls.abandoned == 4                          # still running, their threads replaced
    finally:
        release.set()
    assert [o.timed_out for o in outs] == [True] * 4 + [False] * 8
    assert [o.value for o in outs[4:]] == list(range(4, 12))
    assert str(outs[0].error) == "no answer within 0.2 s (--x.timeout_s)"
    assert took < 2.0, took                                  # two rounds of timeouts, not a queue behind them
    deadline = time.time() + 5
    while calls.abandoned and time.time() < deadline:        # the hung calls return: their threads exit
        time.sleep(0.01)
    assert calls.abandoned == 0
    calls.close()


def test_async_calls_are_cancelled_and_errors_and_awaitables_come_back() -> None:
    calls = BoundedCalls(4, 0.2, "t", "--x.timeout_s")
    cancelled = []

    async def hangs() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    def raises() -> None:
        raise ValueError("boom")

    async def value() -> int:
        return 7

    async def main() -> list:
        return [await calls.run(hangs), await calls.run(raises), await calls.run(value),
                await calls.run(lambda: value(), on_pool=False)]

    hung, bad, ok, awaited = asyncio.run(main())
    assert hung.timed_out and cancelled == [True]
    assert isinstance(bad.error, ValueError) and not bad.timed_out
    assert (ok.value, awaited.value) == (7, 7) and ok.ok
    calls.close()
