"""A real, throw-away `redis-server` on a loopback port, for tests and benchmarks. No Ray.

No persistence (`--save ""`, `--appendonly no`), so stop() then start() on the same port
gives an empty server: that is how tests simulate losing Redis.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOST = "127.0.0.1"
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
LOG_TAIL_BYTES = 2000
START_ATTEMPTS = 3


def redis_server_path() -> str | None:
    """The `redis-server` executable on PATH (or /usr/bin), or None."""
    return shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin")


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _server_pid(port: int) -> int | None:
    """The process id of whatever redis answers on port (from INFO server), or None."""
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as sock:
            sock.sendall(b"INFO server\r\n")
            reply = b""
            while b"\r\nprocess_id:" not in reply or not reply.endswith(b"\r\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    return None
                reply += chunk
    except OSError:
        return None
    line = reply.split(b"\r\nprocess_id:", 1)[1].split(b"\r\n", 1)[0]
    return int(line)


class RedisServer:
    """`with RedisServer() as r: redis.Redis.from_url(r.url)`; stop()/start() keep the port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port
        self._proc: subprocess.Popen | None = None
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        assert self.port is not None, "RedisServer has no port before start()"
        return f"redis://{HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RedisServer:
        """Start (if not running) and wait until it answers; raise RuntimeError if not.

        A port picked here may be taken by someone else before redis binds it, so an
        automatic port is retried a few times; an explicit port (a restart) is not.
        """
        if self.running:
            return self
        auto_port = self.port is None
        attempts_left = START_ATTEMPTS if auto_port else 1
        while True:
            attempts_left -= 1
            self.port = free_port() if auto_port else self.port
            self._spawn()
            try:
                self._wait_ready()
                return self
            except RuntimeError:
                if attempts_left == 0:
                    raise

    def _spawn(self) -> None:
        exe = redis_server_path()
        if exe is None:
            raise RuntimeError("redis-server not found on PATH; install redis (apt redis-server)")
        self._dir = Path(tempfile.mkdtemp(prefix="raykv-redis-"))
        argv = [exe, "--port", str(self.port), "--bind", HOST, "--save", "",
                "--appendonly", "no", "--protected-mode", "yes", "--dir", str(self._dir),
                "--daemonize", "no", "--logfile", ""]
        with open(self._dir / "redis.log", "wb") as log:
            self._proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, cwd=self._dir)

    def _wait_ready(self) -> None:
        deadline_s = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline_s:
            if self._proc.poll() is not None:
                break
            if _server_pid(self.port) == self._proc.pid:
                return
            time.sleep(0.02)
        tail = self._log_tail()
        self.stop()
        raise RuntimeError(f"redis-server (ours) on port {self.port} did not answer "
                           f"within {START_TIMEOUT_S:.0f} s; log tail:\n{tail}")

    def _log_tail(self) -> str:
        try:
            data = (self._dir / "redis.log").read_bytes()
        except (OSError, TypeError):
            return "(no log)"
        return data[-LOG_TAIL_BYTES:].decode(errors="replace")

    def stop(self) -> None:
        """SIGTERM by PID, wait, SIGKILL if it lingers; remove the temp dir. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=STOP_TIMEOUT_S)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def refuse_writes(self, refuse: bool = True) -> None:
        """Make our server refuse every write (NOREPLICAS) while it still serves reads: a
        primary that lost its replicas. refuse=False undoes it."""
        import redis

        client = redis.Redis.from_url(self.url)
        try:
            client.config_set("min-replicas-to-write", 1 if refuse else 0)
        finally:
            client.close()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    """`python -m cluster.tools.redis_server -- CMD ...`: run CMD with a private Redis on loopback,
    its URL in RAYKV_TEST_REDIS_URL, and stop the server afterwards (whatever CMD returns)."""
    command = argv[argv.index("--") + 1:] if "--" in argv else argv
    if not command:
        print("usage: python -m cluster.tools.redis_server -- CMD [ARGS...]", file=sys.stderr)
        return 2
    with RedisServer() as server:
        print(f"redis-server pid {server.pid} on {server.url}", file=sys.stderr)
        env = dict(os.environ, RAYKV_TEST_REDIS_URL=server.url)
        return subprocess.call(command, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
