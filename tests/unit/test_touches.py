"""Optimistic reads told to the node: the first at once, a burst gathered into one report by a
timer, nothing left untold."""

from __future__ import annotations

import time

from cluster.touches import TOUCH_EVERY_S, TouchBatch


def test_first_read_at_once_then_a_burst_in_one_report():
    sent: list[tuple[list, int]] = []
    batch = TouchBatch(lambda keys, reads, released: sent.append((keys, reads)))
    batch.note([b"a", b"b"])
    assert sent == [([b"a", b"b"], 1)]  # the first after a quiet spell: at once
    batch.note([b"b", b"c"])
    batch.note([b"c"])
    batch.note([])  # a read of nothing is no read
    assert len(sent) == 1
    deadline_s = time.monotonic() + 10 * TOUCH_EVERY_S
    while len(sent) < 2 and time.monotonic() < deadline_s:
        time.sleep(0.01)
    assert sent[1] == ([b"b", b"c"], 2)  # the timer sent the burst, keys once each


def test_flush_sends_what_gathered_and_cancels_the_timer():
    sent: list[tuple[list, int]] = []
    batch = TouchBatch(lambda keys, reads, released: sent.append((keys, reads)))
    batch.note([b"a"])
    batch.note([b"d"])
    batch.flush()
    assert sent == [([b"a"], 1), ([b"d"], 1)]
    time.sleep(2 * TOUCH_EVERY_S)
    batch.flush()  # nothing left: nothing sent
    assert len(sent) == 2


def test_a_released_lease_rides_on_the_next_call_or_the_timer():
    sent: list[tuple[list, int, list]] = []
    batch = TouchBatch(lambda keys, reads, released: sent.append((keys, reads, released)))
    batch.release(3)
    batch.release(4)
    assert sent == [] and batch.take_released() == [3, 4]  # an acquire carries them
    assert batch.take_released() == []
    batch.release(5)
    deadline_s = time.monotonic() + 10 * TOUCH_EVERY_S
    while not sent and time.monotonic() < deadline_s:
        time.sleep(0.01)
    assert sent == [([], 0, [5])]  # no call came: the timer told the node


def test_a_touch_after_this_process_left_ray_calls_nothing(monkeypatch):
    """A client's touch timer may fire after ray.shutdown(): a call on an actor handle then
    would make Ray auto-start a new local cluster (two heads in one process; the actor tier
    once lost its driver to it). NodeHandle.touch sends nothing when Ray is not initialized."""
    import ray

    from actors.handles import NodeHandle

    class Method:
        calls: list = []

        def remote(self, *args):
            self.calls.append(args)
            return "ref"

    class Actor:
        touch = Method()

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as after ray.shutdown()
    assert NodeHandle(Actor(), "n").touch(None, ["k"], 1, [7]) is None
    assert Method.calls == []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert NodeHandle(Actor(), "n").touch(None, ["k"], 1, [7]) == "ref"
    assert Method.calls == [(None, ["k"], 1, [7])]


def test_a_demand_batch_or_a_lease_end_after_this_process_left_ray_calls_nothing(monkeypatch):
    """The client's demand timer (a get served without a directory match reports it within
    TOUCH_EVERY_S) and its committer thread may run after ray.shutdown(), as the touch timer
    may: a call then would auto-start a local Ray beside the next (CI lost its driver so)."""
    import ray

    from actors.handles import DirectoryHandle, NodeHandle

    calls: list = []

    class Method:
        def remote(self, *args):
            calls.append(args)
            return "ref"

    class Actor:
        record_demand = Method()
        end_put_lease = Method()

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as after ray.shutdown()
    assert DirectoryHandle([Actor()]).record_demand([[b"k" * 16]]) == []
    assert NodeHandle(Actor(), "n").end_put_lease(3) is None
    assert calls == []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert DirectoryHandle([Actor()]).record_demand([[b"k" * 16]]) == ["ref"]
    assert NodeHandle(Actor(), "n").end_put_lease(3) == "ref"
    assert len(calls) == 2
