"""A Ray head with token authentication, started by `ray start --head` as a separate process
(as a user's shell would), and the clean environments of processes outside its tree.

The head gets a temp dir, a HOME of its own (its token is in that HOME's ~/.ray/auth_token,
where a new local Ray keeps it), 127.0.0.1 and explicit ports. It is ended by the PIDs of the
processes under its temp dir, never by `ray stop` (other Rays run on this machine).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
START_TIMEOUT_S = 120


@dataclass(frozen=True)
class Head:
    address: str     # host:port of its GCS
    home: str        # the HOME whose ~/.ray/auth_token holds the cluster's token
    token_path: str  # that file
    root: str        # its temp dir

    def env(self, **extra: str) -> dict[str, str]:
        """A clean environment outside the head's process tree: PATH, PYTHONPATH (this
        checkout), a HOME of its own with no token in it, RAY_ADDRESS, and `extra`."""
        home = os.path.join(self.root, "client-home")
        os.makedirs(home, exist_ok=True)
        return {"PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": REPO, "HOME": home,
                "RAYKV_DISK_DIR": os.path.join(self.root, "disk"),
                "RAY_ADDRESS": self.address, **extra}


def _free_ports(count: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]


@contextlib.contextmanager
def token_auth_head(num_cpus: int = 1, resources: str = '{"kv_node": 1}') -> Iterator[Head]:
    """A token-auth Ray head for the duration of the block; ended by PID afterwards."""
    root = tempfile.mkdtemp(prefix="raykv-auth-", dir="/tmp")
    home = os.path.join(root, "home")
    os.makedirs(os.path.join(home, ".ray"))
    token_path = os.path.join(home, ".ray", "auth_token")
    with open(token_path, "w") as file:
        file.write(secrets.token_hex(32))
    gcs, *ports = _free_ports(8)
    names = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port",
             "--ray-client-server-port")
    command = [os.path.join(BIN, "ray"), "start", "--head", f"--temp-dir={root}/ray",
               "--port", str(gcs), "--node-ip-address", "127.0.0.1",
               "--num-cpus", str(num_cpus), "--resources", resources,
               "--object-store-memory", str(100 << 20), "--include-dashboard", "false",
               "--disable-usage-stats"]
    for name, port in zip(names, ports, strict=True):
        command += [name, str(port)]
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": REPO, "HOME": home,
           "RAY_AUTH_MODE": "token", "VLLM_CPU_KVCACHE_SPACE": "1"}
    try:
        started = subprocess.run(command, env=env, capture_output=True, text=True,
                                 timeout=START_TIMEOUT_S)
        assert started.returncode == 0, started.stderr[-2000:]
        yield Head(f"127.0.0.1:{gcs}", home, token_path, root)
    finally:
        _end(root)


def _end(root: str) -> None:
    """Terminate (then kill) every process whose command line names the head's temp dir."""
    mine = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(root in arg for arg in proc.info["cmdline"] or ()):
                mine.append(proc)
    for proc in mine:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(mine, timeout=10)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
