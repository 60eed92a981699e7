"""Tenant isolation and access on a running service: namespaces never read each other's pages
(even for the same tokens), a tenant cannot probe another's prefixes (a per-namespace secret
in the key chain), quotas hold under concurrent pressure, no file or shared-memory name comes
from user input, and raykv listens on nothing beyond what Ray does (its page servers aside)."""

from __future__ import annotations

import os
import re
import threading

import blake3
import psutil
import ray
import torch

from cluster import ModelSpec, Quota, add_namespace, connect, start, stop
from cluster.core.keys import namespace_key, page_keys
from cluster.core.tiers.node_slot import slot_shm_prefix
from tests.kv import kv_for

TINY = ModelSpec.preset("tiny-llama")  # 16 tokens a page here: 8 KiB pages
PAGE = 8192
TOKENS = list(range(1000, 1064))  # four pages


def test_namespaces_never_read_each_others_pages(service):
    service()
    add_namespace("tenant-a")
    add_namespace("tenant-b")
    a, b = connect(TINY, "tenant-a"), connect(TINY, "tenant-b")
    kv_a, kv_b = kv_for(TINY, 64, 1), kv_for(TINY, 64, 2)
    assert b.put(TOKENS, kv_b) == 64
    assert a.lookup(TOKENS) == 0 and a.get(TOKENS) == (0, None)
    assert a.put(TOKENS, kv_a) == 64  # the same tokens: A's own pages, not B's
    assert torch.equal(a.get(TOKENS)[1], kv_a) and torch.equal(b.get(TOKENS)[1], kv_b)
    assert not set(a.keys(TOKENS)) & set(b.keys(TOKENS))


def test_a_tenant_cannot_probe_anothers_prefixes(service):
    config = service()
    add_namespace("tenant-b")
    owner = connect(TINY, "tenant-b")
    prober = connect(TINY, "default")
    assert owner.put(TOKENS, kv_for(TINY, 64, 3)) == 64
    assert len(owner.locate_keys(owner.keys(TOKENS))) == 4
    # The prober knows the name and the tokens; the keys it can compute find nothing.
    for guess in (b"", blake3.blake3(b"tenant-b").digest(32), b"tenant-b".ljust(32, b"\0")):
        assert prober.locate_keys(page_keys(TINY, "tenant-b", 16, TOKENS, guess)) == []
    assert owner.chain.root != namespace_key(TINY, "tenant-b", 16)
    # The secret outlives a restart of the service (kept in the disk dir here): same keys.
    keys = owner.keys(TOKENS)
    stop()
    start(config)
    add_namespace("tenant-b")
    assert connect(TINY, "tenant-b").keys(TOKENS) == keys


def test_quotas_hold_under_concurrent_pressure(service):
    service(device_bytes=0, host_bytes=24 * PAGE, disk_bytes=0, chunk_bytes=4 * PAGE)
    add_namespace("greedy", Quota(max_bytes=8 * PAGE))
    add_namespace("steady", Quota(min_bytes=8 * PAGE))
    steady = connect(TINY, "steady")
    prompts = [list(range(i * 32, i * 32 + 32)) for i in range(4)]  # 8 pages, its floor
    for index, tokens in enumerate(prompts):
        assert steady.put(tokens, kv_for(TINY, 32, index)) == 32
    held: list[int] = []
    errors: list[BaseException] = []

    def flood(first: int) -> None:
        greedy = connect(TINY, "greedy")
        try:
            for index in range(first, first + 40):
                greedy.put(list(range(index * 32, index * 32 + 32)), kv_for(TINY, 32, index))
                tiers = greedy.stats()["node"]["memory"]["tiers"]["host"]["namespaces"]
                held.append(tiers.get("greedy", 0))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=flood, args=(100 + 100 * i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and len(held) == 120, errors
    assert max(held) <= 8 * PAGE, max(held)  # never past its max, even with three writers
    for index, tokens in enumerate(prompts):  # the floor: nothing of steady's was evicted
        hit, kv = steady.get(tokens)
        assert hit == 32 and torch.equal(kv, kv_for(TINY, 32, index))


FILE_NAMES = re.compile(r"^(node-\d+(\.lock)?|\d+(x\d+)+-[a-z0-9]+|slab-\d{5}\.bin|"
                        r"manifest\.json|pool\.json|key-secret)$")
# The node's memory tiers, their slot generations, the device tier's readers file
# (tiers/chunk_readers.py) and its held-pages index (a random id).
SHM_NAMES = re.compile(r"^raykv-[0-9a-f]{8}-\d+-"
                       r"(host-[0-9a-f]{12}(-gen)?|device-[0-9a-f]{12}(-gen|-readers)?"
                       r"|held-[0-9a-f]{12})$")


def test_no_file_name_comes_from_user_input(service, disk_root):
    service(host_bytes=8 * PAGE, device_bytes=0)  # small: pages go to disk
    hostile = ["../../etc/evil", "a/b", "x" * 120, "ünï\u202ecode", "..", "spaced name"]
    for name in hostile:
        add_namespace(name)
        spec = ModelSpec("../" + name, 2, 2, 16, "float32")
        client = connect(spec, name)
        for index in range(3):
            client.put(list(range(index * 32, index * 32 + 32)), kv_for(spec, 32, index))
    names = [n for _, dirs, files in os.walk(disk_root) for n in dirs + files]
    assert names and [n for n in names if not FILE_NAMES.match(n)] == []
    assert any(n.startswith("slab-") for n in names)
    prefix = slot_shm_prefix(disk_root)  # this service's segments (other runs have theirs)
    ours = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    assert ours and [n for n in ours if not SHM_NAMES.match(n)] == []
    assert any("-held-" in n for n in ours)
    for name in ours:  # shared memory is the node's and its same-user clients' only
        assert os.stat(os.path.join("/dev/shm", name)).st_mode & 0o077 == 0, name
    for path in (os.path.join(root, n) for root, dirs, files in os.walk(disk_root)
                 for n in files):
        assert os.stat(path).st_mode & 0o077 == 0, path  # nothing readable by others


@ray.remote(num_cpus=0)
class Plain:
    """A Ray actor that does nothing: what any Ray worker listens on."""

    def pid(self) -> int:
        return os.getpid()


def alive_actors(class_names: tuple[str, ...]) -> list[dict]:
    """{"class_name", "pid"} of the live actors of these classes (from the GCS's actor table:
    the state API needs the dashboard, which these tests do not start)."""
    from ray._private import state

    return [{"class_name": a["ActorClassName"], "pid": a["Pid"]}
            for a in state.actors().values()
            if a["State"] == "ALIVE" and a["ActorClassName"] in class_names]


def listening(pid: int) -> list[tuple[str, int]]:
    return sorted((c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet")
                  if c.status == psutil.CONN_LISTEN)


def test_raykv_listens_only_where_ray_does_and_on_its_page_servers(service):
    service()
    client = connect(TINY)
    client.put(TOKENS, kv_for(TINY, 64, 4))
    # The handle is held while its sockets are read: an actor whose last handle is dropped is
    # torn down at once, and 10 ms later its listener was gone (a baseline of 0 that failed CI).
    plain = Plain.remote()
    baseline = len(listening(ray.get(plain.pid.remote())))
    ray.kill(plain)
    assert baseline >= 1  # Ray's own worker server
    actors = alive_actors(("NodeCacheActor", "DirectoryShard", "Controller", "ControlLoop"))
    assert {a["class_name"] for a in actors} >= {"NodeCacheActor", "DirectoryShard",
                                                 "Controller"}
    page_server = client.stats()["node"]["dataplane"]["endpoint"]
    host, port = page_server.rsplit(":", 1)
    node_ip = ray.util.get_node_ip_address()
    for actor in actors:
        sockets = listening(actor["pid"])
        if actor["class_name"] == "NodeCacheActor":
            assert (host, int(port)) in sockets and host == node_ip  # never 0.0.0.0
            sockets.remove((host, int(port)))
        assert len(sockets) == baseline, (actor["class_name"], sockets)
    before = listening(os.getpid())
    client.get(TOKENS)
    assert listening(os.getpid()) == before  # a client opens no listener
