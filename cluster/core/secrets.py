"""The key chain's secrets: one master secret per service, one secret per namespace.

    master          32 bytes: RAYKV_KEY_SECRET (any string, stretched by blake3's derive_key)
                    if set; else the one in Redis (when configured; the first controller to
                    get there sets it); else a 0600 file in the disk dir (made on first use)
    namespace       blake3(namespace, key=master): a MAC of the name, so it cannot be
                    derived from the name without the master
    chain root      H("raykv-ns-v2" | namespace secret | geometry | namespace | page size)

Only the controller holds the master; a client gets its own namespace's secret when it
connects, the ingress gets the secrets of the namespaces it serves. So one who can see page
keys (in Redis, in the directory, in metrics) or ask about them (lookups) cannot test whether
another tenant holds a prefix: the keys of that tenant's tokens depend on a secret the prober
does not have.

The master must outlive the service for disk pages to be found again after a restart: a
multi-node service sets RAYKV_KEY_SECRET (the manifests take it from a Kubernetes Secret) or
runs with Redis; the file is for one machine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets

import blake3

log = logging.getLogger("raykv.secrets")
SECRET_BYTES = 32
ENV_VAR = "RAYKV_KEY_SECRET"
FILE_NAME = "key-secret"
_CONTEXT = "raykv 2026 master key secret v1"


def namespace_secret(master: bytes, namespace: str) -> bytes:
    """The namespace's secret: a keyed blake3 of its name under the master."""
    if len(master) != SECRET_BYTES:
        raise ValueError(f"the master secret must be {SECRET_BYTES} bytes, got {len(master)}")
    return blake3.blake3(namespace.encode(), key=master).digest(SECRET_BYTES)


def from_passphrase(value: str) -> bytes:
    """A master secret from an operator's string (RAYKV_KEY_SECRET)."""
    if not value:
        raise ValueError(f"{ENV_VAR} is empty")
    return blake3.blake3(value.encode(), derive_key_context=_CONTEXT).digest(SECRET_BYTES)


def load_master(disk_dir: str, redis_url: str | None, redis_key: str,
                environ: dict | None = None) -> tuple[bytes, str]:
    """(the service's master secret, where it came from: "env", "redis" or "file")."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_VAR):
        return from_passphrase(environ[ENV_VAR]), "env"
    if redis_url:
        try:
            return _from_redis(redis_url, redis_key), "redis"
        except Exception as error:  # Redis down: a file one (pages stay right, may miss)
            log.warning("key secret: Redis unreachable (%s); using the disk dir's file", error)
    return _from_file(os.path.join(disk_dir, FILE_NAME)), "file"


def forget_master(source: str, disk_dir: str, redis_url: str | None, redis_key: str) -> None:
    """Remove a master that the service made (a purge: its pages are gone with it). One from
    the environment is the operator's, and stays."""
    if source == "file":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(disk_dir, FILE_NAME))
    elif source == "redis" and redis_url:
        import redis

        client = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=1.0)
        try:
            client.delete(redis_key)
        finally:
            client.close()


def _from_redis(url: str, key: str) -> bytes:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=1.0)
    try:
        client.set(key, secrets.token_bytes(SECRET_BYTES), nx=True)  # the first one wins
        value = client.get(key)
    finally:
        client.close()
    if value is None or len(value) != SECRET_BYTES:
        raise ValueError(f"{key} in Redis is not a {SECRET_BYTES}-byte secret")
    return bytes(value)


def _from_file(path: str) -> bytes:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        with open(path, "rb") as file:
            value = file.read()
        if len(value) != SECRET_BYTES:
            raise ValueError(f"{path} is not a {SECRET_BYTES}-byte secret; remove it to make "
                             "a new one (cached pages will then miss)") from None
        return value
    value = secrets.token_bytes(SECRET_BYTES)
    with os.fdopen(fd, "wb") as file:
        file.write(value)
    return value
