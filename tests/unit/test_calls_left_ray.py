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
