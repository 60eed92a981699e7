"""The engine tier's subscriber against vLLM's own publisher (ZmqEventPublisher, real ZMQ on
127.0.0.1): batches applied, a batch lost on the wire replayed, a restarted publisher taken as
a new engine, and a loss the replay cannot fill dropping what it cannot trust."""

from __future__ import annotations

import time

import pytest

from cluster.core.keys import KeyChain
from cluster.core.spec import ModelSpec
from cluster.tools.redis_server import free_port

pytest.importorskip("vllm")
pytest.importorskip("zmq")

from vllm.distributed.kv_events import (  # noqa: E402
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from cluster.serving.engine_events import EngineEvents  # noqa: E402

PAGE, BLOCK = 16, 4
CHAIN = KeyChain.of(ModelSpec("m", 2, 1, 8, "float32"), "default", PAGE)
PROMPT = [(i * 31 + 7) % 5000 for i in range(4 * PAGE)]
KEYS = CHAIN.keys(PROMPT)


class LoopbackPublisher(ZmqEventPublisher):
    """vLLM's publisher, bound to a loopback address (its own rule binds only wildcard
    addresses; servers here bind 127.0.0.1), dropping chosen batches on the PUB socket only:
    they stay in its replay buffer, as a batch a subscriber missed would."""

    def __init__(self, endpoint: str, replay_endpoint: str, drop: set[int],
                 buffer_steps: int = 10_000):
        self.drop = drop
        super().__init__(0, endpoint=endpoint, replay_endpoint=replay_endpoint,
                         buffer_steps=buffer_steps)
        self._pub = _Dropping(self._pub, drop)

    @staticmethod
    def _is_bind_endpoint(endpoint: str) -> bool:
        return True


class _Dropping:
    def __init__(self, sock, drop: set[int]):
        self._sock, self._drop = sock, drop

    def send_multipart(self, frames):
        if int.from_bytes(frames[1], "big") not in self._drop:
            self._sock.send_multipart(frames)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def source(endpoint: str, replay_endpoint: str, epoch: str) -> dict:
    """What a replica's routing stats advertise (RaykvLLMServer)."""
    return {"endpoint": endpoint, "replay_endpoint": replay_endpoint, "epoch": epoch}


def blocks(first: int, count: int) -> BlockStored:
    """vLLM's BlockStored for blocks first.. of PROMPT (block i hashed 1000 + i)."""
    return BlockStored(block_hashes=[1000 + i for i in range(first, first + count)],
                       parent_block_hash=999 + first if first else None,
                       token_ids=PROMPT[first * BLOCK : (first + count) * BLOCK],
                       block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None)


def publish(publisher: ZmqEventPublisher, *events) -> None:
    publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))


def rebound(make):
    """A publisher on the endpoints of one just shut down (ZMQ frees a port a moment after
    its socket closes)."""
    import zmq

    deadline = time.monotonic() + 5.0
    while True:
        try:
            return make()
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def wait_for(check, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError("timed out")


@pytest.fixture
def endpoints():
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def test_lost_batches_are_replayed_and_a_restart_starts_over(endpoints):
    pub, replay = endpoints
    first = LoopbackPublisher(pub, replay, drop={1})
    events = EngineEvents(CHAIN, replay_timeout_s=2.0)
    try:
        events.watch({"r1": source(pub, replay, "e1")})
        publish(first, blocks(0, 4))  # page 0
        wait_for(lambda: events.stats().get("r1", {}).get("next_seq") == 1)
        publish(first, blocks(4, 4))  # page 1: lost on the wire
        publish(first, blocks(8, 4))
        publish(first, blocks(12, 4))
        wait_for(lambda: events.stats()["r1"]["next_seq"] == 4)
        stats = events.stats()["r1"]
        assert (stats["gaps"], stats["drops"], stats["blocks"]) == (1, 0, 16)
        assert events.held_pages(KEYS, ["r1", "r2"]) == {"r1": 4}

        first.shutdown()  # the engine restarts: its numbers start over
        second = rebound(lambda: LoopbackPublisher(pub, replay, drop={1, 2}, buffer_steps=1))
        time.sleep(1.0)  # the SUB socket reconnects
        publish(second, blocks(0, 4))
        wait_for(lambda: events.stats()["r1"]["restarts"] == 1)
        assert events.held_pages(KEYS, ["r1"]) == {"r1": 1}

        # Lost for good: the removal of page 0's last block (and another batch); the
        # publisher keeps only its last batch, so the replay cannot fill the hole.
        publish(second, BlockRemoved(block_hashes=[1003], medium="GPU"))
        publish(second, blocks(4, 4))
        publish(second, BlockStored(block_hashes=[7], parent_block_hash=None,
                                    token_ids=[1] * BLOCK, block_size=BLOCK, lora_id=None,
                                    medium="GPU", lora_name=None))
        wait_for(lambda: events.stats()["r1"]["next_seq"] == 4)
        stats = events.stats()["r1"]
        assert (stats["gaps"], stats["drops"], stats["blocks"]) == (2, 1, 1)
        assert events.held_pages(KEYS, ["r1"]) == {"r1": 0}  # page 0 is not trusted
        second.shutdown()
    finally:
        events.close()


def test_a_late_joiner_replays_from_the_start_and_a_new_epoch_starts_over(endpoints):
    pub, replay = endpoints
    publisher = LoopbackPublisher(pub, replay, drop=set())
    events = EngineEvents(CHAIN)
    try:
        publish(publisher, blocks(0, 8))
        publish(publisher, blocks(8, 8))
        time.sleep(0.3)  # published before anyone listens: only the replay has them
        events.watch({"r1": source(pub, replay, "e1")})
        wait_for(lambda: events.stats().get("r1", {}).get("next_seq") == 2)
        assert events.held_pages(KEYS, ["r1"]) == {"r1": 4}
        events.watch({"r1": source(pub, replay, "e2")})  # the replica's engine is new
        wait_for(lambda: events.stats().get("r1", {}).get("epoch") == "e2"
                 and events.stats()["r1"]["next_seq"] == 2)
        assert events.stats()["r1"]["batches"] == 2  # a new stream, replayed from 0
        assert events.held_pages(KEYS, ["r1"]) == {"r1": 4}
        events.watch({})
        wait_for(lambda: not events.stats())
    finally:
        publisher.shutdown()
        events.close()


def _outsider(kind: int, endpoint: str, keys=None):
    """A socket of one who is not the relay's reader: no keys, or a key pair of its own
    (`keys`: (public, secret)) with the relay's public key, which is public."""
    import zmq

    sock = zmq.Context.instance().socket(kind)
    sock.linger = 0
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def test_a_relay_serves_its_reader_only_and_replays_through_it():
    """vLLM's publisher on ipc sockets in a 0700 directory, relayed behind CURVE: the router
    with the advertised keys follows it, a lost batch replayed through the relay; a listener
    with no keys, or with a key pair of its own, gets no batch and no replay; closing removes
    the sockets' directory, and a replica whose relay stopped advertises no events."""
    import os
    import stat
    from types import SimpleNamespace

    import zmq

    from cluster.serving.events_relay import EventsRelay, private_endpoints
    from cluster.serving.vllm_events_server import RaykvLLMServer

    private_dir, pub, replay = private_endpoints()
    assert stat.S_IMODE(os.stat(private_dir).st_mode) == 0o700
    publisher = LoopbackPublisher(pub, replay, drop={1})
    relay = EventsRelay(pub, replay, "127.0.0.1", private_dir)
    events = EngineEvents(CHAIN, replay_timeout_s=2.0)
    server_key = relay.keys.server_key.encode()
    plain_sub = _outsider(zmq.SUB, relay.endpoint)
    own_sub = _outsider(zmq.SUB, relay.endpoint, (*zmq.curve_keypair(), server_key))
    plain_replay = _outsider(zmq.DEALER, relay.replay_endpoint)
    own_replay = _outsider(zmq.DEALER, relay.replay_endpoint, (*zmq.curve_keypair(), server_key))
    try:
        assert relay.endpoint.startswith("tcp://127.0.0.1:") and relay.endpoint != pub
        assert sorted(os.listdir(private_dir)) == ["events", "replay"]
        replica = SimpleNamespace(_raykv_relay=relay, _raykv_events=relay.advertised("e1"))
        assert RaykvLLMServer._events_advertised(replica) == relay.advertised("e1")
        events.watch({"r1": relay.advertised("e1")})
        wait_for(lambda: "r1" in events.stats() and not events.stats()["r1"]["replaying"])
        time.sleep(0.5)  # every listener has had time to connect
        publish(publisher, blocks(0, 4))
        publish(publisher, blocks(4, 4))  # lost on the wire: the replay goes through the relay
        publish(publisher, blocks(8, 4))
        publish(publisher, blocks(12, 4))
        wait_for(lambda: events.held_pages(KEYS, ["r1"]) == {"r1": 4})
        assert events.stats()["r1"]["gaps"] == 1 and events.stats()["r1"]["drops"] == 0
        for sock in (plain_replay, own_replay):
            try:  # a DEALER refused by the relay has no peer to queue a request for
                sock.send_multipart((b"", (0).to_bytes(8, "big")), zmq.NOBLOCK)
            except zmq.Again:
                pass
        time.sleep(1.0)
        for sock in (plain_sub, own_sub, plain_replay, own_replay):
            assert not sock.poll(0), "an outsider read the engine's events"
    finally:
        for sock in (plain_sub, own_sub, plain_replay, own_replay):
            sock.close(linger=0)
        events.close()
        relay.close()
        publisher.shutdown()
    assert not os.path.exists(private_dir)
    # A replica whose relay has stopped tells routers nothing of its events any more (they
    # drop the engine's blocks rather than keep them unchanged).
    assert not relay.alive and RaykvLLMServer._events_advertised(replica) == {}


def test_a_relay_whose_engine_takes_no_replays_still_relays_events():
    """Replay requests that vLLM does not take (here no replay socket is bound, so they
    queue up to ZMQ's limit) never block the relay: past the limit they are dropped, each
    reader's replay times out, and events still flow."""
    import zmq

    from cluster.serving.events_relay import CurveKeys, EventsRelay, private_endpoints

    private_dir, pub, replay = private_endpoints()
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.linger = 0
    publisher.bind(pub)
    relay = EventsRelay(pub, replay, "127.0.0.1", private_dir)
    keys = CurveKeys.of(relay.advertised("e")["curve"])
    reader, asker = (zmq.Context.instance().socket(kind) for kind in (zmq.SUB, zmq.DEALER))
    try:
        for sock, endpoint in ((reader, relay.endpoint), (asker, relay.replay_endpoint)):
            sock.linger = 0
            keys.apply(sock)
            sock.connect(endpoint)
        reader.setsockopt(zmq.SUBSCRIBE, b"")
        asker.sndhwm = 0  # no limit on the reader's side: the relay's own limit is tested
        for _ in range(3000):
            asker.send_multipart((b"", (0).to_bytes(8, "big")))
        time.sleep(1.0)  # the relay has read them all, or is stuck on the first it could not
        deadline = time.monotonic() + 10.0
        while not reader.poll(100) and time.monotonic() < deadline:
            publisher.send_multipart((b"", (7).to_bytes(8, "big"), b"batch"))
        assert reader.recv_multipart()[2] == b"batch" and relay.alive
    finally:
        reader.close()
        asker.close()
        relay.close()
        publisher.close()


def test_a_real_engine_s_events_map_to_the_pages_raykv_keys(model_dir):
    """vLLM's CPU engine with its events on as RaykvLLMServer turns them on (ipc sockets in a
    private directory, read back from the engine as the server reads them, relayed behind
    CURVE): the prompt's full blocks come back as the raykv pages they make whole, and a
    prefix-cache reset clears them."""
    from types import SimpleNamespace

    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    from cluster.serving.events_relay import EventsRelay, private_endpoints
    from cluster.serving.vllm_events_server import bound_sources, kv_events_config
    from tests.vllm.conftest import prompt_tokens

    private_dir, endpoint, replay = private_endpoints()
    configured = kv_events_config({}, (endpoint, replay))
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, seed=0, max_model_len=2048,
              enable_prefix_caching=True, kv_events_config=KVEventsConfig(**configured))
    page_tokens = 256  # raykv's default page: two of vLLM's 128-token CPU blocks
    chain = KeyChain.of(ModelSpec("small-llama", 4, 2, 64, "float32"), "default", page_tokens)
    events = EngineEvents(chain)
    relay = None
    try:
        bound = bound_sources(SimpleNamespace(_engine_client=llm.llm_engine), configured)
        assert bound == (endpoint, replay)
        relay = EventsRelay(*bound, "127.0.0.1", private_dir)
        source = relay.advertised("e")
        assert source["endpoint"].startswith("tcp://127.0.0.1:") and source["curve"]
        events.watch({"r": source})
        wait_for(lambda: "r" in events.stats() and not events.stats()["r"]["replaying"])
        prompt = prompt_tokens(600, seed=3)
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1),
                     use_tqdm=False)
        keys = chain.keys(prompt)  # 2 pages; vLLM's full blocks hold 512 tokens: 2 pages
        wait_for(lambda: events.held_pages(keys, ["r"]) == {"r": 2})
        assert events.held_pages(chain.keys(prompt_tokens(600, seed=4)), ["r"]) == {"r": 0}
        llm.reset_prefix_cache()
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1),
                     use_tqdm=False)  # a step, which publishes the reset
        wait_for(lambda: events.held_pages(keys, ["r"]) == {"r": 0})
        assert events.stats()["r"]["drops"] == 0
    finally:
        events.close()
        if relay is not None:
            relay.close()
        llm.llm_engine.engine_core.shutdown()


def test_the_raykv_router_s_app_turns_each_engine_s_events_on():
    from types import SimpleNamespace

    from vllm.config import KVEventsConfig

    from cluster.serving import vllm_app
    from cluster.serving.vllm_events_server import (
        ANY_PORT,
        RaykvLLMServer,
        TokenizingLLMServer,
        advertised,
        kv_events_config,
    )

    raykv = vllm_app.VllmAppArgs("/m", "small-llama", request_router_class=vllm_app.RAYKV_ROUTER)
    assert vllm_app.llm_config(raykv).server_cls is RaykvLLMServer
    # Serve's own router: no events, but vLLM's tokenization server handed over
    assert vllm_app.llm_config(vllm_app.VllmAppArgs("/m", "small-llama")).server_cls \
        is TokenizingLLMServer
    assert kv_events_config({}) == {"enable_kv_cache_events": True, "publisher": "zmq",
                                    "endpoint": ANY_PORT, "replay_endpoint": ANY_PORT}
    own = {"enable_kv_cache_events": True, "endpoint": "tcp://*:6000"}
    assert kv_events_config({"kv_events_config": own}) == own  # a user's own is kept
    assert kv_events_config({}, ("ipc:///d/events", "ipc:///d/replay"))["replay_endpoint"] \
        == "ipc:///d/replay"

    bound = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                           endpoint="tcp://10.1.2.3:41000", replay_endpoint="tcp://10.1.2.3:41001")
    engine = SimpleNamespace(_engine_client=SimpleNamespace(engine_core=SimpleNamespace(
        get_kv_event_sources=lambda: {0: bound})))
    assert advertised(engine, kv_events_config({}), "e1") == {
        "endpoint": "tcp://10.1.2.3:41000", "replay_endpoint": "tcp://10.1.2.3:41001",
        "epoch": "e1"}
    # Not bound where the server can see it (an in-process engine core): nothing advertised.
    unknown = SimpleNamespace(_engine_client=SimpleNamespace(engine_core=SimpleNamespace(
        get_kv_event_sources=dict)))
    assert advertised(unknown, kv_events_config({}), "e1") == {}
    assert advertised(engine, {"enable_kv_cache_events": False}, "e1") == {}


def test_a_replica_s_events_go_on_ipc_sockets_in_a_private_directory(monkeypatch):
    """By default the engine publishes on ipc sockets in a fresh 0700 directory (relayed
    behind CURVE once it runs); a user's own configuration is kept as set; an engine of two
    data-parallel ranks, which vLLM 0.32 cannot give each its own ipc socket (it raises for
    rank 1), publishes on OS-picked ports at the node's address, as before the relay."""
    import os
    import shutil
    import stat
    from types import SimpleNamespace

    from cluster.serving.vllm_events_server import ANY_PORT, RaykvLLMServer, relays_on_ipc

    def configured(engine_kwargs: dict):
        server = SimpleNamespace(_llm_config=SimpleNamespace(engine_kwargs=engine_kwargs))
        return RaykvLLMServer._events_config(server)

    config, private_dir = configured({})
    try:
        assert stat.S_IMODE(os.stat(private_dir).st_mode) == 0o700
        assert config["endpoint"] == f"ipc://{private_dir}/events"
        assert config["replay_endpoint"] == f"ipc://{private_dir}/replay"
    finally:
        shutil.rmtree(private_dir)
    own = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:6000"}
    assert configured({"kv_events_config": own}) == (own, None)
    assert relays_on_ipc({"data_parallel_size": 1}) and not relays_on_ipc({"data_parallel_size": 2})
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    config, private_dir = configured({"data_parallel_size": 2})
    assert private_dir is None and config["endpoint"] == ANY_PORT == config["replay_endpoint"]


def test_vllm_binds_ray_s_node_address_unless_the_user_chose_one():
    """vLLM binds tcp://*:0 on VLLM_HOST_IP when set, else on its default route's address;
    the server sets it to Ray's address for the node, so the events are served where Ray's
    and raykv's own servers are, never on another interface."""
    from cluster.serving.vllm_events_server import pin_bind_address

    environ: dict = {}
    assert pin_bind_address(environ, "10.0.0.7") == "10.0.0.7"
    assert environ == {"VLLM_HOST_IP": "10.0.0.7"}
    environ = {"VLLM_HOST_IP": "127.0.0.1"}  # the user's choice stands
    assert pin_bind_address(environ, "10.0.0.7") == "127.0.0.1"
    assert environ == {"VLLM_HOST_IP": "127.0.0.1"}


def test_vllm_s_wire_format_decodes_to_plain_gpu_blocks_only():
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared

    from cluster.core.engine_blocks import Cleared, Removed, Stored
    from cluster.serving.engine_events import _readable, decode_batch

    def stored(**fields):
        return BlockStored(**{"block_hashes": [b"h1", 2], "parent_block_hash": None,
                              "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None,
                              "medium": "GPU", "lora_name": None, **fields})

    batch = KVEventBatch(ts=1.0, events=[
        stored(), stored(extra_keys=[None, ("salt",)]), stored(lora_id=3, lora_name="a"),
        stored(medium="CPU"), stored(group_idx=1), BlockRemoved(block_hashes=[2], medium="GPU"),
        BlockRemoved(block_hashes=[2], medium="CPU"), AllBlocksCleared()])
    events = decode_batch(msgspec.msgpack.Encoder().encode(batch))
    assert events == [Stored((b"h1", 2), None, (1, 2, 3, 4), 2, True),
                      Stored((b"h1", 2), None, (1, 2, 3, 4), 2, False),
                      Stored((b"h1", 2), None, (1, 2, 3, 4), 2, False),
                      Removed((2,)), Cleared()]
    assert _readable(b"\xc1 not msgpack") == [Cleared()]  # unreadable: nothing trusted


def test_a_replica_going_away_removes_its_rates_file(tmp_path):
    """Serve's graceful shutdown calls the server's __del__: the engine stops, then the file
    its connector wrote the rates to goes (one per replica start would pile up in /tmp)."""
    import asyncio

    from cluster.serving.engine_rates import write_published
    from cluster.serving.vllm_events_server import RaykvLLMServer

    path = str(tmp_path / "engine-rates" / "e.json")
    write_published(path, {"page_tokens": 16})
    server = object.__new__(RaykvLLMServer)  # as after start(), with no engine left to stop
    server.engine, server._raykv_rates_file = None, path
    asyncio.run(server.__del__())
    assert not (tmp_path / "engine-rates" / "e.json").exists()
