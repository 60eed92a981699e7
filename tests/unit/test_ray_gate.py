"""ray_gate: background calls and ray.shutdown() kept apart (no Ray: is_initialized faked)."""

import threading
import time

import pytest
import ray

from cluster import ray_gate
from cluster.touches import TouchBatch


@pytest.fixture
def ray_up(monkeypatch):  # only the gate's view of Ray (Ray's own log filters ask it too)
    monkeypatch.setattr(ray_gate, "_ray_is_up", lambda: True)
    yield
    ray_gate.reopen()


def test_ray_shutdown_is_wrapped_once_and_keeps_its_name():
    assert ray.shutdown.__raykv_gated__ and ray.shutdown.__name__ == "shutdown"
    ray_gate._install()  # a second import's install leaves one wrapper
    assert not getattr(ray.shutdown.__wrapped__, "__raykv_gated__", False)


def test_a_call_is_refused_without_ray_and_while_the_gate_is_closed(ray_up, monkeypatch):
    with ray_gate.background_call() as allowed:
        assert allowed and ray_gate.in_background()
    assert not ray_gate.in_background()
    assert ray_gate.close(drain_s=0.1)
    with ray_gate.background_call() as allowed:
        assert not allowed
    ray_gate.reopen()
    monkeypatch.setattr(ray_gate, "_ray_is_up", lambda: False)
    with ray_gate.background_call() as allowed:
        assert not allowed


def test_close_waits_for_the_calls_in_flight_and_their_waits_give_up(ray_up):
    slices, finished = [], threading.Event()

    def background():
        with ray_gate.background_call() as allowed:
            assert allowed
            for slice_s in ray_gate.wait_slices(30.0):  # a wait of 30 s, in slices
                slices.append(slice_s)
                time.sleep(slice_s)
        finished.set()

    thread = threading.Thread(target=background)
    thread.start()
    while not slices:
        time.sleep(0.01)
    start_s = time.monotonic()
    assert ray_gate.close(drain_s=5.0)
    waited_s = time.monotonic() - start_s
    assert finished.is_set() and waited_s < 3 * ray_gate.WAIT_SLICE_S
    assert max(slices) <= ray_gate.WAIT_SLICE_S
    thread.join()


def test_close_gives_up_after_drain_s_and_never_waits_for_its_own_thread(ray_up):
    release = threading.Event()

    def stuck():
        with ray_gate.background_call():
            release.wait(5.0)

    thread = threading.Thread(target=stuck)
    thread.start()
    time.sleep(0.05)
    start_s = time.monotonic()
    assert not ray_gate.close(drain_s=0.2)
    assert 0.15 < time.monotonic() - start_s < 2.0
    release.set()
    thread.join()
    ray_gate.reopen()
    with ray_gate.background_call():  # a shutdown from inside a background call
        assert ray_gate.close(drain_s=0.2)


def test_a_wait_outside_background_calls_is_one_slice():
    assert list(ray_gate.wait_slices(7.0)) == [7.0]


def test_a_closed_gate_holds_back_a_batchs_send_and_it_goes_once_open(ray_up):
    sent, gate_open = [], {"open": False}

    class Gate:
        def __enter__(self):
            return gate_open["open"]

        def __exit__(self, *exc):
            return False

    batch = TouchBatch(lambda keys, reads, released: sent.append(keys), gate=Gate)
    batch.note([b"k" * 16])
    time.sleep(0.1)
    assert sent == []  # held back, not lost to an error
    gate_open["open"] = True
    batch.note([b"j" * 16])
    deadline_s = time.monotonic() + 2.0
    while not sent and time.monotonic() < deadline_s:
        time.sleep(0.01)
    assert sent == [[b"k" * 16, b"j" * 16]]

