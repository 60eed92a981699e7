"""A wait in a process that has left Ray fails the call instead of starting a local Ray
(cluster/calls.py): a background thread (the leased puts' committer) can outlive ray.shutdown()."""

from __future__ import annotations

import ray

from cluster.calls import Wait, failed, run_sync


def _one_call(ref):
    (reply,) = yield Wait([ref])
    return reply


def test_a_wait_after_the_process_left_ray_is_a_failed_call_and_starts_no_ray():
    assert not ray.is_initialized()
    ref = ray.ObjectRef.from_random()  # a ref of a session that is gone
    reply = run_sync(_one_call(ref), timeout_s=1.0)
    assert failed(reply) and "left Ray" in str(reply)
    assert not ray.is_initialized()


def test_an_async_wait_that_times_out_says_so_as_the_sync_one_does():
    """asyncio's TimeoutError has no text: the client's log read "did not answer; local
    pages miss: " with nothing after it. Now both paths say "no answer within ... s"."""
    import asyncio

    from cluster.calls import _wait_async

    async def never():
        await asyncio.Event().wait()

    async def scenario():
        return await _wait_async([never()], 0.05)

    (reply,) = asyncio.run(scenario())
    assert isinstance(reply, TimeoutError) and str(reply) == "no answer within 0.05 s"
