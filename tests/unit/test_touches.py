"""Optimistic reads told to the node: the first soon after, a burst gathered into one report,
nothing left untold, and every report sent by the sender thread, never the reader's; a
client's call metrics recorded the same way."""

from __future__ import annotations

import threading
import time

from cluster.touches import TOUCH_EVERY_S, MetricBatch, TouchBatch


def wait_for(condition, timeout_s: float = 10 * TOUCH_EVERY_S) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, "nothing was sent in time"
        time.sleep(0.002)


def recording(sent: list) -> TouchBatch:
    """A batch whose sends are kept with the thread that made them."""
    return TouchBatch(lambda keys, reads, released: sent.append(
        (keys, reads, released, threading.current_thread())))


def test_first_read_soon_after_then_a_burst_in_one_report_off_the_readers_thread():
    sent: list = []
    batch = recording(sent)
    batch.note([b"a", b"b"])
    wait_for(lambda: len(sent) == 1)  # the first after a quiet spell: TOUCH_SOON_S after
    assert sent[0][:2] == ([b"a", b"b"], 1)
    batch.note([b"b", b"c"])
    batch.note([b"c"])
    batch.note([])  # a read of nothing is no read
    started_s = time.monotonic()
    wait_for(lambda: len(sent) == 2)
    assert time.monotonic() - started_s > TOUCH_EVERY_S / 2  # gathered, not sent at once
    assert sent[1][:2] == ([b"b", b"c"], 2)  # one report of the burst, keys once each
    assert all(thread is not threading.current_thread() for *_, thread in sent)


def test_flush_sends_what_gathered_and_the_due_send_finds_nothing():
    sent: list = []
    batch = recording(sent)
    batch.note([b"a"])
    batch.note([b"d"])
    batch.flush()
    assert [s[:2] for s in sent] == [([b"a", b"d"], 2)]
    assert sent[0][3] is threading.current_thread()  # an explicit flush sends from its caller
    time.sleep(2 * TOUCH_EVERY_S)
    batch.flush()  # nothing left: nothing sent
    assert len(sent) == 1


def test_a_released_lease_rides_on_the_next_call_or_the_next_report():
    sent: list = []
    batch = recording(sent)
    batch.release(3)
    batch.release(4)
    assert sent == [] and batch.take_released() == [3, 4]  # an acquire carries them
    assert batch.take_released() == []
    batch.release(5)
    wait_for(lambda: sent)
    assert [s[:3] for s in sent] == [([], 0, [5])]  # no call came: the report told the node


def test_many_batches_share_one_sender_thread():
    sent: list = []
    batches = [recording(sent) for _ in range(20)]
    before = threading.active_count()
    for i, batch in enumerate(batches):
        batch.note([bytes([i])])
    assert threading.active_count() <= before + 1  # none per batch or per read
    wait_for(lambda: len(sent) == len(batches))
    assert len({thread for *_, thread in sent}) == 1


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


def test_a_forked_child_reports_with_a_sender_of_its_own():
    """The parent's sender thread does not exist in a forked child: the child's reads are
    sent by a sender the child starts."""
    import os

    read_fd, write_fd = os.pipe()
    batch = TouchBatch(lambda keys, reads, released: os.write(write_fd, b"".join(keys)))
    batch.note([b"p"])
    assert os.read(read_fd, 1) == b"p"  # the parent's sender is running, and sent it
    pid = os.fork()
    if pid == 0:  # the child: one read, left for its sender to report
        try:
            batch.note([b"c"])
            time.sleep(4 * TOUCH_EVERY_S)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as reader:
        assert reader.read() == b"c"


class RecordedMetrics:
    """actors.metrics.Metrics' calls, kept with the thread that made them."""

    def __init__(self):
        self.records: list = []

    def observe(self, name: str, seconds: float) -> None:
        self.records.append(("observe", name, seconds, threading.current_thread()))

    def count(self, name: str, value: float, **tags: str) -> None:
        self.records.append(("count", name, value, tags, threading.current_thread()))


def test_call_metrics_are_recorded_by_the_sender_with_bytes_summed_per_path():
    metrics, made = RecordedMetrics(), []
    batch = MetricBatch(lambda: made.append(threading.current_thread()) or metrics)
    batch.note("get", 0.002, (("get_local", 4096),))
    batch.note("get", 0.003, (("get_local", 1024), ("get_remote", 512)), fetch_s=0.001)
    batch.note("put", 0.004, ())
    assert metrics.records == [] and made == []  # nothing on the caller's path
    wait_for(lambda: len(metrics.records) == 6)
    observed = [r[1:3] for r in metrics.records if r[0] == "observe"]
    assert observed == [("raykv_get_latency_s", 0.002), ("raykv_get_latency_s", 0.003),
                        ("raykv_fetch_latency_s", 0.001), ("raykv_put_latency_s", 0.004)]
    counted = {r[3]["path"]: r[2] for r in metrics.records if r[0] == "count"}
    assert counted == {"get_local": 5120, "get_remote": 512}
    assert all(r[-1] is not threading.current_thread() for r in metrics.records)
    assert len(made) == 1 and made[0] is not threading.current_thread()
    batch.note("get", 0.001, ())
    batch.flush()  # stats() flushes: recorded now, by its caller
    assert metrics.records[-1][1:3] == ("raykv_get_latency_s", 0.001)
