"""RedisServer: a real redis-server on loopback, restartable on the same port, no persistence."""

import os

import pytest
import redis

from cluster.tools.redis_server import RedisServer, redis_server_path

pytestmark = pytest.mark.skipif(redis_server_path() is None, reason="redis-server not installed")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_set_get_restart_same_port_loses_data():
    with RedisServer() as server:
        port = server.port
        assert server.url == f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(server.url)
        assert client.set(b"k", b"v" * 1000)
        assert client.get(b"k") == b"v" * 1000
        client.close()

        first_pid = server.pid
        server.stop()
        assert server.pid is None and not server.running
        assert not _alive(first_pid)
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(server.url, socket_connect_timeout=1).ping()

        server.start()
        assert server.port == port and server.pid != first_pid
        client = redis.Redis.from_url(server.url)
        assert client.get(b"k") is None
        assert client.dbsize() == 0
        client.close()


def test_stop_is_idempotent_and_start_is_too():
    server = RedisServer()
    server.stop()  # never started
    server.start()
    pid = server.pid
    assert server.start().pid == pid  # already running: no second server
    server.stop()
    server.stop()
    assert not _alive(pid)


def test_explicit_port_taken_fails_with_log_tail():
    with RedisServer() as first:
        second = RedisServer(port=first.port)
        with pytest.raises(RuntimeError, match="log tail"):
            second.start()
        assert second.pid is None
        assert redis.Redis.from_url(first.url).ping()
