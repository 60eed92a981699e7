"""ray.shutdown() while a raykv background call waits on an actor (cluster/ray_gate.py): the
call gives up as Ray goes, the shutdown completes and the process lives on. Run in a process
of its own, with its own local Ray: a thread that reaches Ray's core worker during its
teardown ends that process (CI on 4aebc37 lost its pytest run that way)."""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, threading, time
    import ray
    from cluster import ray_gate
    from cluster.calls import Wait, run_sync

    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")

    @ray.remote
    class Slow:
        def nap(self, seconds):
            time.sleep(seconds)
            return seconds

    slow = Slow.remote()
    ray.get(slow.nap.remote(0))
    seen = {}

    def background():
        def steps():
            (reply,) = yield Wait([slow.nap.remote(20.0)])
            return reply

        with ray_gate.background_call() as allowed:
            seen["allowed"] = allowed
            seen["reply"] = repr(run_sync(steps(), 30.0))
        seen["done_s"] = time.monotonic()

    thread = threading.Thread(target=background, daemon=True)
    thread.start()
    time.sleep(1.0)  # the call is out, its wait blocked on the actor
    start_s = time.monotonic()
    ray.shutdown()
    seen["shutdown_s"] = time.monotonic() - start_s
    seen["call_ended_before_shutdown_returned"] = seen.get("done_s", 1e18) <= time.monotonic()
    seen["shutdown_began_s"] = start_s
    with ray_gate.background_call() as allowed:  # after the shutdown: refused, not a new Ray
        seen["allowed_after"] = allowed
    seen["ray_up_after"] = ray.is_initialized()
    print("RESULT " + json.dumps(seen), flush=True)
""")


def test_a_background_wait_gives_up_as_ray_shuts_down_and_the_process_lives():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=180, cwd=root)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.returncode, done.stdout[-2000:],
                                            done.stderr[-4000:])
    seen = json.loads(lines[-1][len("RESULT "):])
    assert seen["allowed"] and "Ray is shutting down" in seen["reply"], seen
    assert seen["call_ended_before_shutdown_returned"], seen
    assert seen["done_s"] - seen["shutdown_began_s"] < 6.0, seen  # not the actor's 20 s
    assert not seen["allowed_after"] and not seen["ray_up_after"], seen
