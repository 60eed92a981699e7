"""The key chain's secrets: a namespace's secret is a MAC of its name under the master (not
derivable from the name), the master comes from RAYKV_KEY_SECRET, Redis or a 0600 file (and
is the same the next time), and it changes every key of the namespace."""

from __future__ import annotations

import os
import stat

import blake3
import pytest
import redis

from cluster.core.keys import KeyChain, namespace_key, page_keys
from cluster.core.secrets import (
    ENV_VAR,
    FILE_NAME,
    SECRET_BYTES,
    forget_master,
    from_passphrase,
    load_master,
    namespace_secret,
)
from cluster.core.spec import ModelSpec

SPEC = ModelSpec("tiny", 2, 2, 16, "float32")
TOKENS = list(range(64))


def test_a_namespace_secret_is_a_mac_of_its_name():
    master, other = b"m" * 32, b"o" * 32
    secret = namespace_secret(master, "tenant-b")
    assert len(secret) == SECRET_BYTES and secret == namespace_secret(master, "tenant-b")
    assert secret != namespace_secret(master, "tenant-a")
    assert secret != namespace_secret(other, "tenant-b")
    # Not anything one can compute from the name alone.
    assert secret not in {blake3.blake3(b"tenant-b").digest(32), b"tenant-b".ljust(32, b"\0")}
    with pytest.raises(ValueError, match="32 bytes"):
        namespace_secret(b"short", "tenant-b")


def test_the_secret_changes_every_key_of_the_namespace():
    secret = namespace_secret(b"m" * 32, "tenant-b")
    keyed = page_keys(SPEC, "tenant-b", 16, TOKENS, secret)
    guessed = page_keys(SPEC, "tenant-b", 16, TOKENS)  # a prober knows the name, not the secret
    assert len(keyed) == 4 and not set(keyed) & set(guessed)
    assert KeyChain.of(SPEC, "tenant-b", 16, secret).keys(TOKENS) == keyed
    assert namespace_key(SPEC, "tenant-b", 16, secret) != namespace_key(SPEC, "tenant-b", 16)


def test_the_master_comes_from_the_environment_first(tmp_path):
    master, source = load_master(str(tmp_path), None, "k", {ENV_VAR: "correct horse"})
    assert (master, source) == (from_passphrase("correct horse"), "env")
    assert len(master) == SECRET_BYTES and not os.listdir(tmp_path)
    with pytest.raises(ValueError):
        from_passphrase("")


def test_the_file_master_is_private_and_kept(tmp_path):
    master, source = load_master(str(tmp_path / "disk"), None, "k", {})
    path = tmp_path / "disk" / FILE_NAME
    assert source == "file" and path.read_bytes() == master
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_master(str(tmp_path / "disk"), None, "k", {}) == (master, "file")
    path.write_bytes(b"torn")
    with pytest.raises(ValueError, match="remove it"):
        load_master(str(tmp_path / "disk"), None, "k", {})


def test_the_first_master_set_in_redis_wins_and_a_dead_redis_falls_back(tmp_path):
    url = os.environ.get("RAYKV_TEST_REDIS_URL")
    if not url:
        pytest.skip("no test redis-server (make test starts one)")
    key = f"raykv-test:{os.getpid()}:key-secret"
    try:
        first = load_master(str(tmp_path), url, key, {})
        assert first[1] == "redis" and load_master(str(tmp_path), url, key, {}) == first
    finally:
        redis.Redis.from_url(url).delete(key)
    dead = load_master(str(tmp_path), "redis://127.0.0.1:1/0", key, {})
    assert dead[1] == "file"


def test_a_purge_forgets_a_made_master_but_never_the_operators(tmp_path):
    master, source = load_master(str(tmp_path), None, "k", {})
    forget_master(source, str(tmp_path), None, "k")
    assert not (tmp_path / FILE_NAME).exists()
    assert load_master(str(tmp_path), None, "k", {})[0] != master  # a new one next time
    forget_master("env", str(tmp_path), None, "k")  # the operator's: nothing to remove
    assert (tmp_path / FILE_NAME).exists()
