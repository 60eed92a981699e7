"""Ray Serve LLM's LLMServer with its vLLM engine's KV-cache events on, advertised to raykv's
router (the engine tier: cluster/serving/engine_events.py).

Ray's KVAwareRouter turns vLLM's events on itself, and only for its own deployments
(ray.llm._internal.serve.routing_policies.kv_aware.vllm.kv_events): a ZMQ publisher per
replica, its PUB and replay (ROUTER) ports offset by the replica's node-local rank, advertised
through `record_routing_stats`. Those sockets have no authentication, and the events carry the
token ids of every prompt the engine caches. This server turns them on for raykv's router
another way:

  - before its engine starts, it sets `engine_kwargs["kv_events_config"]` (a user's own is
    kept, and served as the user set it) to ipc sockets in a fresh 0700 directory, which
    only this user can open;
  - once the engine runs, it relays them on TCP ports the OS picks at Ray's address for this
    node, behind ZMQ CURVE with keys made for this engine (cluster/serving/events_relay.py),
    and advertises the relay's endpoints and keys under ENGINE_EVENTS with an epoch naming
    this engine: a replica is never taken for another. Routing stats reach routers over Ray,
    whose token authenticates every call.

An engine of several data-parallel ranks on a vLLM that cannot give each rank its own ipc
socket publishes as before this relay: on `tcp://*:0` at Ray's address for this node
(`VLLM_HOST_IP`, unless the user set it), unauthenticated, with a warning.

It also publishes what the engine's RaykvConnector measures (its loads' rates per source tier,
its prefill rate, its compute seconds per request: cluster/serving/engine_rates.py) under
"rates", as raykv's own engine replicas do (cluster/serving/deployments.py), for the router's
cost model and `raykv status`. The connector's scheduler side runs in vLLM's engine-core
process, this replica's child on the same host: before the engine starts, the server names a
file for it (`raykv.rates_file` in the connector's settings, a user's own kept), which the
connector rewrites at most once a second and this server reads when Serve asks for its
routing stats.

The builder (cluster/serving/vllm_app.py) makes it the server class when the router is raykv's,
and TokenizingLLMServer (its base: LLMServer with vLLM's tokenization server handed over, for
/tokenize and /detokenize) for any other router.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid

import zmq
from ray.llm._internal.serve.core.server.llm_server import LLMServer

from cluster.serving.engine_rates import rates_path, read_published, remove_published
from cluster.serving.events_relay import EventsRelay, private_endpoints
from cluster.serving.router import ENGINE_EVENTS

log = logging.getLogger("raykv.vllm")
ANY_PORT = "tcp://*:0"  # vLLM binds this node's address on a port the OS picks


def kv_events_config(engine_kwargs: dict, endpoints: tuple[str, str] | None = None) -> dict:
    """The engine's kv_events_config: the user's, else a ZMQ publisher with a replay socket at
    `endpoints` (events, replay), by default on ports the OS picks."""
    own = engine_kwargs.get("kv_events_config")
    if own:
        return dict(own)
    endpoint, replay = endpoints or (ANY_PORT, ANY_PORT)
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
            "replay_endpoint": replay}


def relays_on_ipc(engine_kwargs: dict) -> bool:
    """Whether vLLM can publish this engine's events on ipc sockets: one data-parallel rank,
    or a vLLM that gives each rank its own ipc endpoint (0.32 raises for rank 1)."""
    if int(engine_kwargs.get("data_parallel_size") or 1) <= 1:
        return True
    from vllm.distributed.kv_events import ZmqEventPublisher

    try:
        return ZmqEventPublisher.offset_endpoint_port("ipc:///x", 1) != "ipc:///x"
    except ValueError:
        return False


def bound_sources(engine, configured: dict) -> tuple[str | None, str | None]:
    """(events, replay) endpoints vLLM bound for its first rank (its engine client's
    get_kv_event_sources), else the configured ones."""
    sources = {}
    try:
        sources = engine._engine_client.engine_core.get_kv_event_sources()
    except AttributeError:  # another engine client: fall back on the configuration
        pass
    if sources:
        bound = sources[min(sources)]
        return bound.endpoint, bound.replay_endpoint
    return configured.get("endpoint"), configured.get("replay_endpoint")


def advertised(engine, configured: dict, epoch: str) -> dict:
    """What the replica tells routers of its events: the endpoints vLLM bound (its engine
    client's get_kv_event_sources), else the configured ones at this node's address; {} when
    neither is known (the router then routes this replica without its engine tier)."""
    if not configured.get("enable_kv_cache_events"):
        return {}
    endpoint, replay = bound_sources(engine, configured)
    if not endpoint or endpoint.endswith(":0"):
        log.warning("vLLM's KV events endpoint is not known (%s): the router will not see "
                    "this engine's cache", endpoint)
        return {}
    return {"endpoint": _routable(endpoint), "epoch": epoch,
            "replay_endpoint": _routable(replay) if replay and not replay.endswith(":0")
            else None}


def pin_bind_address(environ: dict, node_ip: str) -> str:
    """The address vLLM binds `tcp://*:0` on: the user's `VLLM_HOST_IP` if set, else Ray's
    address for this node, written into `environ` so that the engine-core process, which
    inherits it and runs the publisher, binds there. Returns the address."""
    own = environ.get("VLLM_HOST_IP")
    if own:
        return own
    environ["VLLM_HOST_IP"] = node_ip
    return node_ip


def with_rates_file(kv_transfer: dict | None, path: str) -> dict | None:
    """The engine's kv_transfer_config with RaykvConnector's rates file named (`path`, unless
    the user named one); None when the engine runs no RaykvConnector (nothing to publish)."""
    if not isinstance(kv_transfer, dict) or kv_transfer.get("kv_connector") != "RaykvConnector":
        return None
    extra = dict(kv_transfer.get("kv_connector_extra_config") or {})
    extra.setdefault("raykv.rates_file", path)
    return {**kv_transfer, "kv_connector_extra_config": extra}


def adopt_tokenization(engine) -> bool:
    """Give Ray Serve LLM's engine vLLM's tokenization server, which it looks for under the
    name vLLM gave it before (`openai_serving_tokenization`; vLLM 0.32 names it
    `serving_tokenization`): without it `/tokenize` and `/detokenize` answer 400 ("This model
    does not support the 'tokenization' task"). Whether it was given."""
    if getattr(engine, "_oai_serving_tokenization", None) is not None:
        return False
    served = getattr(getattr(engine, "_app_state", None), "serving_tokenization", None)
    if served is None:
        return False
    engine._oai_serving_tokenization = served
    return True


def _bind_on_node_address() -> bool:
    """Point vLLM's `tcp://*:0` at Ray's address for this node (pin_bind_address, into this
    process's environment); whether that address is a concrete one vLLM can bind."""
    import ray

    address = pin_bind_address(os.environ, ray.util.get_node_ip_address())
    return address not in ("", "0.0.0.0", "::")


def _routable(endpoint: str) -> str:
    """A wildcard-bound endpoint at this node's address (as Ray's KV router rewrites it)."""
    if "*" not in endpoint:
        return endpoint
    import ray

    port = endpoint.rsplit(":", 1)[1]
    return f"tcp://{ray.util.get_node_ip_address()}:{port}"


class TokenizingLLMServer(LLMServer):
    """LLMServer with vLLM 0.32's tokenization server handed over (adopt_tokenization), for
    /tokenize and /detokenize: the server class of raykv's vLLM apps whatever their router
    (a router may still refuse such a request: Ray's PrefixCacheAffinityRouter raises on one
    without a prompt)."""

    async def start(self):
        await super().start()
        adopt_tokenization(self.engine)


class RaykvLLMServer(TokenizingLLMServer):
    """LLMServer whose engine publishes KV events for raykv's router (module docstring)."""

    async def start(self):
        self._raykv_events: dict = {}
        self._raykv_relay = None
        self._raykv_rates_file = None
        kv_transfer = with_rates_file(self._llm_config.engine_kwargs.get("kv_transfer_config"),
                                      rates_path(uuid.uuid4().hex))
        if kv_transfer is not None:
            self._llm_config.update_engine_kwargs(kv_transfer_config=kv_transfer)
            self._raykv_rates_file = kv_transfer["kv_connector_extra_config"]["raykv.rates_file"]
        configured, private_dir = self._events_config()
        self._llm_config.update_engine_kwargs(kv_events_config=configured)
        try:
            await super().start()
        except BaseException:
            if private_dir is not None:
                shutil.rmtree(private_dir, ignore_errors=True)
            raise
        epoch = uuid.uuid4().hex
        if private_dir is None:
            self._raykv_events = advertised(self.engine, configured, epoch)
        else:
            self._raykv_events = self._relay(configured, private_dir, epoch)
        log.info("vLLM KV events for raykv's router: %s",
                 {k: v for k, v in self._raykv_events.items() if k != "curve"})

    def _events_config(self) -> tuple[dict, str | None]:
        """(the engine's kv_events_config, the private directory of its ipc sockets: None
        when vLLM serves its sockets itself)."""
        engine_kwargs = self._llm_config.engine_kwargs
        own = engine_kwargs.get("kv_events_config")  # the user's own: served as they set it
        if not own and relays_on_ipc(engine_kwargs):
            private_dir, endpoint, replay = private_endpoints()
            return kv_events_config(engine_kwargs, (endpoint, replay)), private_dir
        if not own:
            log.warning("vLLM cannot publish the KV events of several data-parallel ranks on "
                        "ipc sockets: they are served unauthenticated on this node's address")
        configured = kv_events_config(engine_kwargs)
        if configured.get("endpoint") == ANY_PORT and not _bind_on_node_address():
            # vLLM would refuse to start its engine: route this replica without its events.
            log.warning("vLLM finds no address of this node to publish KV events on (set "
                        "VLLM_HOST_IP): raykv's router will not see this engine's cache")
            return {"enable_kv_cache_events": False}, None
        return configured, None

    def _relay(self, configured: dict, private_dir: str, epoch: str) -> dict:
        """The engine's ipc sockets relayed behind CURVE at this node's address; what routers
        are told ({}: not relayed, routed without this engine's cache)."""
        import ray

        events_in, replay_in = bound_sources(self.engine, configured)
        try:
            self._raykv_relay = EventsRelay(events_in, replay_in,
                                            ray.util.get_node_ip_address(), private_dir)
        except (zmq.ZMQError, OSError) as error:
            log.warning("the KV events relay did not start (%s): raykv's router will not see "
                        "this engine's cache", error)
            shutil.rmtree(private_dir, ignore_errors=True)
            return {}
        return self._raykv_relay.advertised(epoch)

    def _events_advertised(self) -> dict:
        """What routers are told of this engine's events; {} once its relay has stopped, so
        that routers drop what they hold of this engine rather than keep it unchanged."""
        relay = getattr(self, "_raykv_relay", None)
        if relay is not None and not relay.alive:
            return {}
        return getattr(self, "_raykv_events", None) or {}

    async def record_routing_stats(self) -> dict:
        stats = dict(await super().record_routing_stats() or {})
        events = self._events_advertised()
        if events:
            stats[ENGINE_EVENTS] = events
        if getattr(self, "_raykv_rates_file", None):
            stats["rates"] = read_published(self._raykv_rates_file)
        return stats

    async def __del__(self) -> None:
        """Serve's graceful shutdown: the engine stops first (it writes the file), then the
        rates file and the events relay (with its sockets' directory) go."""
        try:
            await super().__del__()
        finally:
            path = getattr(self, "_raykv_rates_file", None)
            if path:
                remove_published(path)
            relay = getattr(self, "_raykv_relay", None)
            if relay is not None:
                relay.close()
