"""start(), connect() and stop(): the public entry points (see DESIGN.md, "Public client API")."""

from __future__ import annotations

import logging
import os
import re
import socket

import ray

from actors.handles import ControllerHandle, ControlLoopHandle, DirectoryHandle, NodeHandle
from actors.spawn import spawn_control_loop, spawn_controller, spawn_directory
from cluster.core.config import CacheConfig
from cluster.core.dataplane.auth import ClientSecrets
from cluster.core.dataplane.connections import close_shared_pool
from cluster.core.errors import ServiceNotRunning
from cluster.core.geometry import PageGeometry
from cluster.core.keys import KeyChain
from cluster.core.membership import kv_nodes
from cluster.core.registry import Registry
from cluster.core.spec import ModelSpec
from cluster.core.store import shm_bytes_per_node
from cluster.core.tiers.memory import SharedMemoryTooSmall, check_shm_room
from policies.quota import Quota

log = logging.getLogger("raykv")
START_TIMEOUT_S = 120.0  # the default wait for each step of start() and for other answers
START_TIMEOUT_ENV = "RAYKV_START_TIMEOUT_S"
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
GCS_PROBE_TIMEOUT_S = 3.0  # a GCS port that takes no TCP connection in this long is not there
_HOST_PORT = re.compile(r"^\[?(?P<host>[^\s/\[\]]+?)\]?:(?P<port>\d{1,5})$")  # not ray://


def _ensure_ray(config: CacheConfig) -> None:
    """Use the Ray this process is on; else the cluster RAY_ADDRESS names; else a new local one.

    A bare ray.init() would attach to whatever cluster last ran on this machine, so a local
    start is explicit (`address="local"`), with this node marked as a kv node. A new local
    Ray turns on its token authentication by itself (Ray 2.60), for this process tree.
    """
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        join_ray()
        return
    ray.init(address="local", resources={config.node_resource: 1}, include_dashboard=False,
             logging_level=logging.WARNING)


def ray_token_source() -> str | None:
    """Where Ray would read this process's auth token: "RAY_AUTH_TOKEN", the file
    RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token (what a new local Ray writes); None
    when no token is at hand. ValueError when RAY_AUTH_TOKEN_PATH names no readable token
    (Ray would abort the process on it)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    named = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if named:
        if not _has_token(named):
            raise ValueError(f"RAY_AUTH_TOKEN_PATH={named} names no readable, non-empty file; "
                             "point it at the file holding the Ray cluster's token")
        return named
    default = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    return default if _has_token(default) else None


def _has_token(path: str) -> bool:
    try:
        with open(path, "rb") as file:
            return bool(file.read(4096).strip())
    except OSError:
        return False


def _adopt_token_auth() -> str:
    """Turn on Ray's token authentication for this process (and its children) when a token
    is at hand and RAY_AUTH_MODE is unset: Ray does so itself only for address "auto", never
    for an explicit address or RAY_ADDRESS. A token sent to a cluster without token auth is
    ignored there, so adopting it is safe. Returns this process's auth state, in words."""
    mode = os.environ.get(RAY_AUTH_MODE_ENV)
    if mode is not None:
        return f"{RAY_AUTH_MODE_ENV}={mode} (as exported)"
    source = ray_token_source()
    if source is None:
        return f"off ({RAY_AUTH_MODE_ENV} unset, no token in RAY_AUTH_TOKEN, " \
               "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
    from ray._raylet import Config

    os.environ[RAY_AUTH_MODE_ENV] = "token"
    Config.initialize("")  # Ray caches its config: re-read, so this process sees token mode
    log.info("raykv: Ray token authentication on (%s=token), the token from %s",
             RAY_AUTH_MODE_ENV, source)
    return f"{RAY_AUTH_MODE_ENV}=token, the token from {source}"


def join_ray(address: str | None = None) -> None:
    """Connect this process to a running Ray cluster: `address`, else RAY_ADDRESS, else the
    one this machine is part of ("auto"). Every raykv entry point joins Ray through here.

    A cluster with token authentication is joined with the token at hand (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token). A host:port address whose port takes no TCP
    connection within GCS_PROBE_TIMEOUT_S is refused at once (Ray itself would retry for
    minutes). When Ray refuses, or is not there, this raises ConnectionError saying what to
    export or check (logged at DEBUG only: the caller shows it, once).
    """
    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    auth = _adopt_token_auth()
    unreachable = gcs_port_error(target)
    if unreachable is not None:
        raise _refused(target, auth, unreachable)
    try:
        ray.init(address=target, logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, ray.exceptions.AuthenticationError) as error:
        ray.shutdown()  # a failed init leaves half a connection: the next try starts clean
        raise _refused(target, auth, error) from None


def gcs_port_error(target: str, timeout_s: float = GCS_PROBE_TIMEOUT_S) -> OSError | None:
    """The error of a TCP connection to a host:port `target` (its GCS), None when one is
    made; None, untried, for any other target ("auto", "local", a ray:// URL)."""
    match = _HOST_PORT.match(target)
    if match is None:
        return None
    try:
        with socket.create_connection((match["host"], int(match["port"])), timeout=timeout_s):
            return None
    except OSError as error:
        return error


def _refused(target: str, auth: str, error: BaseException) -> ConnectionError:
    hint = auth_hint(target, auth, error)
    log.debug("%s", hint)
    return ConnectionError(hint)


def auth_hint(target: str, auth: str, error: BaseException) -> str:
    """What to export when Ray refused (or did not answer) at `target`."""
    return (f"raykv could not join the Ray cluster at {target!r} ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}). Ray token auth in this "
            f"process: {auth}. If that cluster uses token authentication (a new local Ray "
            "does, since Ray 2.60; its log says InvalidAuthToken), export "
            f"{RAY_AUTH_MODE_ENV}=token and the cluster's token: RAY_AUTH_TOKEN_PATH=<file "
            "holding it> (a local cluster keeps it in ~/.ray/auth_token of the user who "
            "started it) or RAY_AUTH_TOKEN=<the token>. Otherwise check the address and that "
            "Ray runs there.")


def _check_local_shm(config: CacheConfig) -> None:
    """Fail fast, before any actor starts, when this (kv) node's /dev/shm is too small."""
    here = ray.get_runtime_context().get_node_id()
    if here in kv_nodes(config.node_resource, ray.nodes()):
        from cluster.core.pool import PoolLimits
        from cluster.core.tiers.memory import cuda_available

        limits = PoolLimits(config.device_bytes, config.host_bytes, config.disk_bytes,
                            use_cuda=cuda_available())
        check_shm_room(shm_bytes_per_node(limits))


def start_timeout_s() -> float:
    """How long start() waits for each of its steps: RAYKV_START_TIMEOUT_S seconds if set,
    else START_TIMEOUT_S (120). ValueError for a value that is not a positive number."""
    raw = os.environ.get(START_TIMEOUT_ENV, "").strip()
    if not raw:
        return START_TIMEOUT_S
    try:
        value_s = float(raw)
    except ValueError:
        value_s = float("nan")
    if not 0 < value_s < float("inf"):
        raise ValueError(f"{START_TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return value_s


def _start_step(ref, step: str, timeout_s: float):
    """ray.get of one step of start(), within `timeout_s` (start_timeout_s()); a step that
    does not answer in time is a TimeoutError that names it and the setting, not Ray's bare
    GetTimeoutError."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"raykv start: {step} did not answer within {timeout_s:g} s. A busy machine, or a "
            f"cluster still starting its nodes, can take longer: set {START_TIMEOUT_ENV} to "
            f"more seconds and start again (start is idempotent: what came up is kept)."
        ) from None


def start(config: CacheConfig | None = None) -> dict:
    """Ensure the directory shards, one node actor per kv node and (with
    `config.rebalance`) the control loop exist; idempotent.

    Raises TypeError for a config that is not a CacheConfig, ValueError when a service with
    another config runs (or RAYKV_START_TIMEOUT_S is not a positive number),
    SharedMemoryTooSmall (a RuntimeError) when a node's /dev/shm cannot hold the configured
    tiers, and TimeoutError naming a step that did not answer within start_timeout_s().
    """
    if config is not None and not isinstance(config, CacheConfig):
        raise TypeError(f"config must be a CacheConfig (or None for the defaults), got "
                        f"{type(config).__name__}; e.g. CacheConfig(**settings)")
    config = config or CacheConfig()
    timeout_s = start_timeout_s()  # a bad value is refused before anything starts
    _ensure_ray(config)
    _check_local_shm(config)
    directory = spawn_directory(config)
    running = CacheConfig.model_validate_json(
        _start_step(directory.get_config(), "the directory's first shard", timeout_s))
    if running != config:
        raise ValueError("a raykv service with a different CacheConfig is already running on this "
                         f"Ray cluster: {running.model_dump()}; call stop() first")
    shards = _start_step(directory.ready(), "the directory's shards", timeout_s)
    controller = spawn_controller(config)
    members = _start_step(controller.sync_members(),
                          "the controller, starting a node actor on each kv node,", timeout_s)
    _raise_node_failures(members["failures"])
    if config.rebalance:
        _start_step(spawn_control_loop(config).start(), "the control loop", timeout_s)
    return {"nodes": members["members"], "directory": shards}


def ensure_running(config: CacheConfig | None = None) -> CacheConfig:
    """The running service's config; the service is started with `config` (None: the
    defaults) only when none runs. A service that runs with other settings than `config` is
    adopted as it is (its page size among them), and this says so: what a Serve app builder
    does, so that the order in which `raykv start` and the app come up never matters. With
    `config` None nothing was asked of the service, so it is adopted with no warning."""
    wanted = CacheConfig() if config is None else config
    _ensure_ray(wanted)
    try:
        running = running_config(wanted.ray_namespace)
    except RuntimeError:
        start(wanted)
        return wanted
    if config is not None and running != config:
        differ = {name: value for name, value in running.model_dump().items()
                  if getattr(config, name) != value}
        log.warning("raykv already runs on this Ray cluster with %s (pages of %d tokens): "
                    "adopted as it is; the settings given here are not used", differ,
                    running.page_tokens)
    return running


def _raise_node_failures(failures: dict[str, str]) -> None:
    if not failures:
        return
    lines = "; ".join(f"node {node_id[:12]}: {why}" for node_id, why in failures.items())
    error = SharedMemoryTooSmall if any("shm" in why or "shared memory" in why
                                        for why in failures.values()) else RuntimeError
    raise error(f"raykv could not start on {len(failures)} node(s): {lines}")


def running_config(ray_namespace: str = "raykv") -> CacheConfig:
    ref = DirectoryHandle.first_shard_config(ray_namespace)
    if ref is None:
        raise ServiceNotRunning("raykv is not running on this Ray cluster; call start() first")
    return CacheConfig.model_validate_json(ray.get(ref, timeout=START_TIMEOUT_S))


def connect(spec: ModelSpec, namespace: str = "default"):
    """A client for one model and tenant namespace on the running service.

    Raises TypeError/ValueError for a bad spec or an unknown namespace (add one with
    add_namespace), ValueError for a spec whose name is registered with another geometry, or
    when the node refuses the model's page geometry (past max_geometries, or a page larger
    than every tier), RuntimeError when raykv is not running. A model not registered yet is
    registered with the default quota.
    """
    from cluster.client import KVClient

    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    join_ray()
    config = running_config()
    registry = _registry(config)
    registry.check_namespace(namespace)
    if not registry.is_registered(spec):  # a new model: registered with the default quota
        _unwrap(_controller(config).register_model(spec, None))
    home = _home_node(config)
    _unwrap(home.open_pool(PageGeometry.of(spec, config.page_tokens)))
    controller = _controller(config)
    secrets = ClientSecrets(_unwrap(controller.namespace_secret(namespace)),
                            _unwrap(controller.peer_key()))
    client = KVClient(spec, namespace, config, DirectoryHandle.lookup(config), home, secrets)
    client.map_slabs()  # now, not on the first get: that one can then read with no call
    return client


def key_chain(spec: ModelSpec, namespace: str = "default",
              page_tokens: int | None = None) -> KeyChain:
    """The page keys of one model and namespace on the running service, its secret included
    (what the ingress and routers key prompts with); `page_tokens` defaults to the service's.
    ValueError for an unknown namespace."""
    config = running_config()
    secret = _unwrap(_controller(config).namespace_secret(namespace))
    return KeyChain.of(spec, namespace, page_tokens or config.page_tokens, secret)


def _unwrap(ref):
    """ray.get, raising a task's ValueError/TypeError as itself (bad input, not a crash)."""
    try:
        return ray.get(ref, timeout=START_TIMEOUT_S)
    except ray.exceptions.RayTaskError as error:
        if isinstance(error.cause, (ValueError, TypeError)):
            raise type(error.cause)(str(error.cause)) from None
        raise


def _controller(config: CacheConfig) -> ControllerHandle:
    controller = ControllerHandle.lookup(config)
    if controller is None:
        raise ServiceNotRunning("raykv's controller is not running; call start() first")
    return controller


def _registry(config: CacheConfig) -> Registry:
    return _unwrap(_controller(config).registry())


def _connected() -> CacheConfig:
    join_ray()
    return running_config()


def register_model(spec: ModelSpec, quota: Quota | None = None) -> dict:
    """Register a model (or change its quota) on the running service, with no restart.

    The quota bounds, per tier and node, the memory its pages may hold: `min_bytes` is never
    reclaimed by other models, `max_bytes` is never passed, and `weight` sets its share of a
    full tier. Returns the registry. ValueError for a name already registered with another
    geometry.
    """
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    if quota is not None and not isinstance(quota, Quota):
        raise TypeError(f"quota must be a Quota, got {type(quota).__name__}")
    return _unwrap(_controller(_connected()).register_model(spec, quota))


def add_namespace(name: str, quota: Quota | None = None) -> dict:
    """Add a namespace (a tenant: its pages are never shared with another) or change its
    quota, on the running service. Returns the registry."""
    if quota is not None and not isinstance(quota, Quota):
        raise TypeError(f"quota must be a Quota, got {type(quota).__name__}")
    return _unwrap(_controller(_connected()).add_namespace(name, quota))


def quotas() -> dict:
    """The registered models and namespaces and their quotas."""
    return _registry(_connected()).describe()


def _home_node(config: CacheConfig) -> NodeHandle:
    here = ray.get_runtime_context().get_node_id()
    local = NodeHandle.lookup(here, config, is_local=True)
    if local is not None:
        return local
    for node_id in kv_nodes(config.node_resource, ray.nodes()):
        remote = NodeHandle.lookup(node_id, config)
        if remote is not None:
            return remote
    raise ServiceNotRunning("no raykv node actor is running; call start() first")


def stop(ray_namespace: str = "raykv") -> None:
    """Kill the service's actors (their shared memory is released with them, their page
    servers closed) and close this process's data-plane connections. Disk pages stay for the
    next start, which recovers them."""
    _stop(ray_namespace, NodeHandle.shutdown)


def purge(ray_namespace: str = "raykv") -> None:
    """stop(), with each live node removing its slab files and slot directory first: nothing
    of the service is left on disk or in /dev/shm. A node that is gone cannot purge; its files
    stay until a start and a purge on that disk."""
    _stop(ray_namespace, NodeHandle.purge, ControllerHandle.purge)


def _stop(ray_namespace: str, release, forget=None) -> None:
    """`release(node handle)`: the node's last call (shutdown or purge); `forget(controller)`:
    the controller's (a purge's: the key secret goes too)."""
    close_shared_pool()
    try:
        config = running_config(ray_namespace)
    except (RuntimeError, ray.exceptions.RayError):
        return
    controller = ControllerHandle.lookup(config)
    if controller is not None and forget is not None:
        try:
            ray.get(forget(controller), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # a dead controller: its secret stays (pages keyed by it are purged anyway)
    for loop in (controller, ControlLoopHandle.lookup(config)):
        if loop is not None:
            loop.kill()
    for node in ray.nodes():
        handle = NodeHandle.lookup(node["NodeID"], config)
        if handle is None:
            continue
        try:
            ray.get(release(handle), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # a dead node's slabs went with it; a restarted actor cleans up stale ones
        handle.kill()
    DirectoryHandle.kill_found(config)


def status() -> dict:
    """The running service at a glance: its config, each node's figures, each tier's use and
    hits over all nodes, the top prefixes, and the registry with what each model and
    namespace holds. A node that does not answer is listed with its error."""
    config = _connected()
    nodes = []
    for node_id in kv_nodes(config.node_resource, ray.nodes()):
        handle = NodeHandle.lookup(node_id, config)
        try:
            stats = ray.get(handle.stats(), timeout=START_TIMEOUT_S) if handle else None
        except (ray.exceptions.RayError, TimeoutError) as error:
            stats = {"error": str(error)}
        nodes.append({"node_id": node_id, **(stats or {"error": "no node actor"})})
    live = [n for n in nodes if "error" not in n]
    for node in live:
        asked = node["hits_pages"] + node["misses_pages"]
        node["hit_ratio"] = node["hits_pages"] / asked if asked else 0.0
    return {"config": config.model_dump(), "nodes": nodes, "tiers": _tier_totals(live),
            "top_prefixes": _top_prefixes(config), "registry": _registry_use(config, live)}


def _tier_totals(nodes: list[dict]) -> dict:
    totals = {}
    all_hits = sum(n.get(f"hits_{t}", 0) for n in nodes for t in ("device", "host", "disk"))
    for tier in ("device", "host", "disk"):
        held = sum(n["memory"]["tiers"][tier]["held_bytes"] for n in nodes)
        capacity = sum(n["memory"]["tiers"][tier]["capacity_bytes"] for n in nodes)
        hits = sum(n.get(f"hits_{tier}", 0) for n in nodes)
        totals[tier] = {"held_bytes": held, "capacity_bytes": capacity,
                        "use": held / capacity if capacity else 0.0, "hits": hits,
                        "hit_share": hits / all_hits if all_hits else 0.0}
    return totals


def _top_prefixes(config: CacheConfig, limit: int = 10) -> list[dict]:
    """The prefixes asked for most lately, over all shards: deepest key, pages, requests and
    how many nodes hold all of it."""
    directory = DirectoryHandle.lookup(config)
    try:
        loads = [load for shard in ray.get(directory.hot_prefixes(limit),
                                           timeout=START_TIMEOUT_S) for load in shard]
    except (ray.exceptions.RayError, TimeoutError):
        return []
    merged: dict[bytes, dict] = {}
    for load in loads:  # a prefix's keys are spread over the shards: add its shares up
        row = merged.setdefault(load.prefix_id, {"key": load.prefix_id.hex(), "pages": 0,
                                                 "requests": 0, "nodes": None})
        row["pages"] += len(load.keys)
        row["requests"] = max(row["requests"], load.num_requests)
        holders = set(load.holders)
        row["nodes"] = holders if row["nodes"] is None else row["nodes"] & holders
    rows = sorted(merged.values(), key=lambda r: -r["requests"])[:limit]
    return [{**row, "nodes": len(row["nodes"])} for row in rows]


def _registry_use(config: CacheConfig, nodes: list[dict]) -> dict:
    described = _registry(config).describe()
    for name, row in described["models"].items():
        row["held_bytes"] = sum(n.get("models", {}).get(name, 0) for n in nodes)
    for name, row in described["namespaces"].items():
        row["held_bytes"] = sum(n["memory"]["tiers"][t]["namespaces"].get(name, 0)
                                for n in nodes for t in ("device", "host", "disk"))
    return described
