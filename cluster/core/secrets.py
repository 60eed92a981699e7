"""The service's secrets: one master secret per service, one secret per namespace, and the
data plane's keys derived from them.

    master          32 bytes, from the first of:
                      RAYKV_KEY_SECRET        any string, stretched by blake3's derive_key
                      RAYKV_KEY_SECRET_FILE   a file holding such a string (a Kubernetes
                                              Secret mounted as a volume)
                      a 0600 file in the controller's disk dir (made on first use)
    namespace       blake3(namespace, key=master): a MAC of the name, so it cannot be
                    derived from the name without the master
    chain root      H("raykv-ns-v2" | namespace secret | geometry | namespace | page size)
    data plane      peer key and node key from the master, request keys from the namespace
                    secrets (cluster/core/dataplane/auth.py)

The master never leaves the controller and never goes to Redis: a Redis read must not yield
the keys of every tenant's pages. (Before, a service without RAYKV_KEY_SECRET kept its master
in Redis; the controller deletes that key at start, and it is never read again.) A client
gets its own namespace's secret when it connects, the ingress gets the secrets of the
namespaces it serves. So one who can see page keys (in Redis, in the directory, in metrics)
or ask about them (lookups) cannot test whether another tenant holds a prefix: the keys of
that tenant's tokens depend on a secret the prober does not have.

The master must outlive the service for disk pages to be found again after a restart: a
multi-node service sets RAYKV_KEY_SECRET or RAYKV_KEY_SECRET_FILE (the manifests take it from
a Kubernetes Secret); the generated file is for one machine (a controller restarted on
another node would make another master: every cached page then misses, none is wrong).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets

import blake3

from cluster.core.tiers.aligned import make_private_dir

log = logging.getLogger("raykv.secrets")
SECRET_BYTES = 32
ENV_VAR = "RAYKV_KEY_SECRET"
FILE_ENV_VAR = "RAYKV_KEY_SECRET_FILE"
FILE_NAME = "key-secret"
_CONTEXT = "raykv 2026 master key secret v1"


def namespace_secret(master: bytes, namespace: str) -> bytes:
    """The namespace's secret: a keyed blake3 of its name under the master."""
    if len(master) != SECRET_BYTES:
        raise ValueError(f"the master secret must be {SECRET_BYTES} bytes, got {len(master)}")
    return blake3.blake3(namespace.encode(), key=master).digest(SECRET_BYTES)


def from_passphrase(value: str) -> bytes:
    """A master secret from an operator's string (RAYKV_KEY_SECRET or its file's text)."""
    if not value:
        raise ValueError(f"{ENV_VAR} is empty")
    return blake3.blake3(value.encode(), derive_key_context=_CONTEXT).digest(SECRET_BYTES)


def load_master(disk_dir: str, environ: dict | None = None) -> tuple[bytes, str]:
    """(the service's master secret, where it came from: "env", "env-file" or "file").
    ValueError for a RAYKV_KEY_SECRET_FILE that cannot be read or is empty; PermissionError
    for a made secret (or its directory) that another user owns, OSError for a link there."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_VAR):
        return from_passphrase(environ[ENV_VAR]), "env"
    if environ.get(FILE_ENV_VAR):
        return _from_operator_file(environ[FILE_ENV_VAR]), "env-file"
    return _from_file(os.path.join(disk_dir, FILE_NAME)), "file"


def forget_master(source: str, disk_dir: str) -> None:
    """Remove a master that the service made (a purge: its pages are gone with it). One from
    the environment or the operator's file stays."""
    if source == "file":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(disk_dir, FILE_NAME))


def delete_legacy_redis_master(redis_url: str, key: str) -> bool:
    """Delete a master secret that an older raykv stored in Redis (never read: it was
    exposed to anyone who could read Redis). True when there was one."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=1.0)
    try:
        return bool(client.delete(key))
    finally:
        client.close()


def _from_operator_file(path: str) -> bytes:
    try:
        with open(path, encoding="utf-8") as file:
            value = file.read().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{FILE_ENV_VAR}={path} cannot be read: {error}") from None
    if not value:
        raise ValueError(f"{FILE_ENV_VAR}={path} is empty")
    return from_passphrase(value)


def _from_file(path: str) -> bytes:
    # The directory and the file must be this user's: in a directory another user made first
    # (the default one under /tmp is predictable), they could read or swap the secret.
    make_private_dir(os.path.dirname(path))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # checked on what was opened
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            os.close(fd)
            raise PermissionError(f"{path} belongs to uid {info.st_uid}, not to this user "
                                  f"({os.getuid()}); refusing to use it as the master secret"
                                  ) from None
        if info.st_mode & 0o077:  # readable by others: make it private again
            log.warning("%s was readable by other users; made it 0600", path)
            os.fchmod(fd, 0o600)
        with os.fdopen(fd, "rb") as file:
            value = file.read()
        if len(value) != SECRET_BYTES:
            raise ValueError(f"{path} is not a {SECRET_BYTES}-byte secret; remove it to make "
                             "a new one (cached pages will then miss)") from None
        return value
    value = secrets.token_bytes(SECRET_BYTES)
    with os.fdopen(fd, "wb") as file:
        file.write(value)
    return value
