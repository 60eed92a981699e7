"""The key chain's secrets: a namespace's secret is a MAC of its name under the master (not
derivable from the name), the master comes from RAYKV_KEY_SECRET, RAYKV_KEY_SECRET_FILE or a
0600 file (and is the same the next time), never from Redis (an old one there is deleted),
and it changes every key of the namespace."""

from __future__ import annotations

import os
import stat

import blake3
import pytest
import redis

from cluster.core.keys import KeyChain, namespace_key, page_keys
from cluster.core.secrets import (
    ENV_VAR,
    FILE_ENV_VAR,
    FILE_NAME,
    SECRET_BYTES,
    delete_legacy_redis_master,
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
    master, source = load_master(str(tmp_path), {ENV_VAR: "correct horse"})
    assert (master, source) == (from_passphrase("correct horse"), "env")
    assert len(master) == SECRET_BYTES and not os.listdir(tmp_path)
    with pytest.raises(ValueError):
        from_passphrase("")


def test_the_master_comes_from_a_mounted_secret_file(tmp_path):
    mounted = tmp_path / "raykv-key-secret"
    mounted.write_text("correct horse\n")  # as kubectl create secret --from-file writes it
    master, source = load_master(str(tmp_path / "disk"), {FILE_ENV_VAR: str(mounted)})
    assert (master, source) == (from_passphrase("correct horse"), "env-file")
    assert not (tmp_path / "disk").exists()
    for bad in (tmp_path / "missing", tmp_path / "empty"):
        if bad.name == "empty":
            bad.write_text("  \n")
        with pytest.raises(ValueError, match=FILE_ENV_VAR):
            load_master(str(tmp_path), {FILE_ENV_VAR: str(bad)})


def test_the_file_master_is_private_and_kept(tmp_path):
    master, source = load_master(str(tmp_path / "disk"), {})
    path = tmp_path / "disk" / FILE_NAME
    assert source == "file" and path.read_bytes() == master
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    assert load_master(str(tmp_path / "disk"), {}) == (master, "file")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # made private again
    path.write_bytes(b"torn")
    with pytest.raises(ValueError, match="remove it"):
        load_master(str(tmp_path / "disk"), {})


def test_a_master_file_or_directory_of_another_user_or_a_link_is_refused(tmp_path):
    """The default directory is predictable (under /tmp): another user who made it, or the
    file, first could read or swap the secret. Neither is used; nor is a symbolic link."""
    master, _ = load_master(str(tmp_path / "disk"), {})
    path = tmp_path / "disk" / FILE_NAME
    path.unlink()
    target = tmp_path / "elsewhere"
    target.write_bytes(master)
    path.symlink_to(target)
    with pytest.raises(OSError):
        load_master(str(tmp_path / "disk"), {})
    path.unlink()
    if os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    load_master(str(tmp_path / "disk"), {})
    os.chown(path, 65534, 65534)
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        load_master(str(tmp_path / "disk"), {})
    (tmp_path / "other").mkdir()
    os.chown(tmp_path / "other", 65534, 65534)
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        load_master(str(tmp_path / "other"), {})


def test_a_master_an_older_raykv_kept_in_redis_is_deleted_never_used(tmp_path):
    url = os.environ.get("RAYKV_TEST_REDIS_URL")
    if not url:
        pytest.skip("no test redis-server (make test starts one)")
    key = f"raykv-test:{os.getpid()}:key-secret"
    old = os.urandom(SECRET_BYTES)
    client = redis.Redis.from_url(url)
    try:
        client.set(key, old)
        master, source = load_master(str(tmp_path), {})
        assert source == "file" and master != old
        assert delete_legacy_redis_master(url, key) and client.get(key) is None
        assert not delete_legacy_redis_master(url, key)
    finally:
        client.delete(key)
        client.close()


def test_a_purge_forgets_a_made_master_but_never_the_operators(tmp_path):
    master, source = load_master(str(tmp_path), {})
    forget_master(source, str(tmp_path))
    assert not (tmp_path / FILE_NAME).exists()
    assert load_master(str(tmp_path), {})[0] != master  # a new one next time
    forget_master("env", str(tmp_path))  # the operator's: nothing to remove
    assert (tmp_path / FILE_NAME).exists()
