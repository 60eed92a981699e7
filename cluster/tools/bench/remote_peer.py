"""The client actors of `raykv bench remote`: a writer on node A, a reader on node B, each a
raykv client as a Serve replica holds one, plus the raw peers (TCP streams, Ray objects)."""

from __future__ import annotations

import time

import numpy as np
import ray

from cluster.tools.bench import common, peers
from cluster.tools.bench.tcp_peer import StreamReader, StreamServer

SPEC = common.LLAMA_8B_KV  # a 1 MiB page is 8 tokens, 4 MiB is 32
TOKEN_STRIDE = 1 << 20  # prompt p's tokens start at p * TOKEN_STRIDE
ADOPT_TIMEOUT_S = 60.0


def prompt_tokens(prompt: int, prompt_bytes: int) -> np.ndarray:
    return np.arange(prompt_bytes // SPEC.bytes_per_token, dtype=np.int64) + prompt * TOKEN_STRIDE


@ray.remote(num_cpus=0, max_restarts=0)
class BenchPeer:
    """A client on one node: the writer on A, the reader on B."""

    def __init__(self) -> None:
        self.client = None
        self.transports: dict = {}
        self.raw: dict[int, list] = {}
        self.server = self.reader = None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def setup(self, page_bytes: int, prompt_bytes: int) -> None:
        """Connect to the running service (one per page size) and allocate touched buffers:
        the prompt's kv, `out` like it, the raw pages and their destination."""
        from cluster import connect

        self.client = self.kv = self.out = self.pool = self.raw_out = None  # free the last
        self.close_streams()
        self.client = connect(SPEC)
        self.prompt_bytes = prompt_bytes
        self.num_pages = prompt_bytes // page_bytes
        self.kv = common.page_kv(SPEC, self.client.page_tokens, self.num_pages)
        self.out = common.touched_like(self.kv)
        self.pool = peers.page_pool(page_bytes, self.num_pages)
        self.raw_out = peers.touched_buffer(page_bytes, self.num_pages)
        self.pulled_pages = ray.get(self.client.local.stats())["pulled_pages"]

    def tokens(self, prompt: int) -> np.ndarray:
        return prompt_tokens(prompt, self.prompt_bytes)

    def keys_of(self, prompt: int) -> list:
        return self.client.keys(self.tokens(prompt))

    # ---- the writer (node A) -------------------------------------------------------------

    def put(self, prompt: int) -> float:
        tokens = self.tokens(prompt)
        put_s, stored = common.timed(lambda: self.client.put(tokens, self.kv))
        if stored != len(tokens):
            raise RuntimeError(f"put stored {stored} of {len(tokens)} tokens (tier full?)")
        return put_s

    def put_raw(self, rep: int) -> list:
        """ray.put each page (the put side, untimed, as raykv's put); keep the refs."""
        self.raw[rep] = [ray.put(page) for page in self.pool]
        return self.raw[rep]

    def drop_raw(self, rep: int) -> None:
        self.raw.pop(rep, None)

    def serve_streams(self) -> tuple[str, int]:
        """Start the raw TCP stream server on this node's address; returns its address."""
        self.server = StreamServer(ray.util.get_node_ip_address(), self.pool)
        return self.server.address

    # ---- the reader (node B) -------------------------------------------------------------

    def located(self, prompt: int) -> int:
        """Pages of the prompt the directory knows of."""
        return len(self.client.locate_keys(self.client.keys(self.tokens(prompt))))

    def get(self, prompt: int) -> float:
        """Seconds of one client.get into `out` (zeroed before, checked after)."""
        tokens = self.tokens(prompt)
        self.out.zero_()
        get_s, (found, _) = common.timed(lambda: self.client.get(tokens, out=self.out))
        if found != len(tokens):
            raise RuntimeError(f"get returned {found} of {len(tokens)} tokens")
        common.check_same(self.out, self.kv, f"get of prompt {prompt}")
        return get_s

    def remote_get(self, prompt: int) -> dict[str, float]:
        """A cold cross-node get, then the wait until this node has pulled the pages the get
        read (off the get's critical path; waited for so it does not overlap what follows)."""
        get_s = self.get(prompt)
        self.pulled_pages += self.num_pages
        start_s = time.perf_counter()
        while ray.get(self.client.local.stats())["pulled_pages"] < self.pulled_pages:
            if time.perf_counter() - start_s > ADOPT_TIMEOUT_S:
                raise RuntimeError(f"pages not pulled within {ADOPT_TIMEOUT_S:.0f} s")
            time.sleep(0.002)
        return {"remote_get": get_s, "pull": time.perf_counter() - start_s}

    def control_s(self, prompt: int) -> float:
        """The get's control plane alone: this node's acquire and the directory's match, sent
        together and both awaited (the prompt is not on this node: the acquire is a miss)."""
        client = self.client
        keys = client.keys(self.tokens(prompt))

        def both() -> None:
            acquired = client.local.acquire(client.geometry, keys)
            _, refs = client.directory.prefix_refs(keys)
            ray.get(refs + [acquired])

        return common.timed(both)[0]

    def dataplane_s(self, prompt: int, endpoint, transport: str | None = None) -> float:
        """The data plane alone: the owner's page server straight into `out`, no Ray call;
        over the client's transport, or the one named (nixl_vs_tcp reads with both)."""
        from cluster.core.dataplane.endpoint import PageRead, TensorPages
        from cluster.core.dataplane.transport import make_transport
        from cluster.core.kvcheck import page_slices

        client = self.client
        keys = tuple(client.keys(self.tokens(prompt)))
        self.out.zero_()
        if transport is not None and transport not in self.transports:
            self.transports[transport] = make_transport(transport)
        wire = client.view.transport if transport is None else self.transports[transport]

        def read() -> list:
            pages = TensorPages(self.out, [self.out[:, :, :, page_slices(p, client.page_tokens)]
                                           for p in range(len(keys))])
            return wire.read([PageRead(endpoint, client.geometry, keys, pages,
                                       client.view.authority)], 30.0)

        read_s, (count,) = common.timed(read)
        if count != len(keys):
            raise RuntimeError(f"the data plane read {count} of {len(keys)} pages")
        common.check_same(self.out, self.kv, f"data plane read of prompt {prompt}")
        return read_s

    def nixl_up(self) -> str | None:
        """None once this process's NIXL agent is up (made in the background), else why not."""
        from cluster.core.dataplane.nixl_agent import shared_agent, unavailable_reason

        if shared_agent(wait_s=120.0) is not None:
            return None
        return unavailable_reason() or "the NIXL agent did not start within 120 s"

    def stream_s(self, address: tuple[str, int], op: bytes) -> float:
        """A raw TCP stream of the same bytes from A's stream server (connection reused)."""
        if self.reader is None:
            self.reader = StreamReader(tuple(address))
        self.raw_out.fill(0)
        seconds = self.reader.read_s(op, self.raw_out)
        peers.check_pool(self.raw_out)
        return seconds

    def stream_rows_s(self, address: tuple[str, int]) -> float:
        """The raw TCP stream scattered into out's page slices (the layout a get fills)."""
        from cluster.core.dataplane.endpoint import storage_bytes, tensor_buffers
        from cluster.core.kvcheck import page_slices

        if self.reader is None:
            self.reader = StreamReader(tuple(address))
        self.out.zero_()
        storage, tokens = storage_bytes(self.out), self.client.page_tokens
        rows = [list(tensor_buffers(self.out[:, :, :, page_slices(p, tokens)], storage))
                for p in range(self.num_pages)]
        seconds = self.reader.read_rows_s(rows)
        common.check_same(self.out, self.kv, "raw stream into out's rows")
        return seconds

    def get_raw(self, refs: list) -> dict[str, float]:
        """ray.get of the pages (A -> B), then a copy of each into a touched buffer."""
        self.raw_out.fill(0)
        fetch_s, pages = common.timed(lambda: ray.get(refs))
        copy_s, _ = common.timed(lambda: [np.copyto(self.raw_out[i], page)
                                          for i, page in enumerate(pages)])
        peers.check_pool(self.raw_out)
        return {"ray": fetch_s + copy_s, "ray_fetch": fetch_s}

    def memcpy_gbps(self) -> float:
        return peers.memcpy_gbps(self.raw_out.shape[1], self.num_pages)

    def close_streams(self) -> None:
        for stream in (self.server, self.reader):
            if stream is not None:
                stream.close()
        self.server = self.reader = None

