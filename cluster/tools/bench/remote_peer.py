"""The client actors of `raykv bench remote`: a writer on node A, a reader on node B, each a
raykv client as a Serve replica holds one, plus the raw peers (TCP streams, Ray objects).
Every reader method checks the bytes it received (untimed) and returns its seconds."""

from __future__ import annotations

import time

import numpy as np
import ray

from cluster.tools.bench import common, peers
from cluster.tools.bench.tcp_peer import StreamReader, StreamServer, raykv_lanes

SPEC = common.LLAMA_8B_KV  # a 1 MiB page is 8 tokens, 4 MiB is 32
TOKEN_STRIDE = 1 << 20  # prompt p's tokens start at p * TOKEN_STRIDE
PULL_TIMEOUT_S = 60.0


def prompt_tokens(prompt: int, prompt_bytes: int) -> np.ndarray:
    return np.arange(prompt_bytes // SPEC.bytes_per_token, dtype=np.int64) + prompt * TOKEN_STRIDE


@ray.remote(num_cpus=0, max_restarts=0)
class BenchPeer:
    """A client on one node: the writer on A, the reader on B."""

    def __init__(self) -> None:
        self.client = None
        self.transports: dict = {}
        self.raw_refs: list = []
        self.server = self.reader = None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def setup(self, page_bytes: int, prompt_bytes: int) -> int:
        """Connect to the running service (one per page size) and allocate touched buffers:
        the prompt's kv, `out` like it, the raw pages and their destination. Returns the
        number of lanes raykv reads a prompt with."""
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
        return raykv_lanes(self.client.geometry, self.num_pages)

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

    def put_raw(self) -> list:
        """ray.put each page (untimed, as raykv's put is); the last round's objects go."""
        self.raw_refs = [ray.put(page) for page in self.pool]
        return self.raw_refs

    def serve_streams(self) -> tuple[str, int]:
        """Start the raw TCP stream server on this node's address; returns its address."""
        self.server = StreamServer(ray.util.get_node_ip_address(), self.pool)
        return self.server.address

    # ---- the reader (node B) -------------------------------------------------------------

    def located(self, prompt: int) -> int:
        """Pages of the prompt the directory knows of."""
        return len(self.client.locate_keys(self.keys_of(prompt)))

    def get(self, prompt: int) -> dict:
        """{"s": seconds of one client.get into `out` (zeroed before, checked after), and the
        pages it read "remote_pages" (from another node) and "local_pages" (from this one)."""
        tokens, before = self.tokens(prompt), dict(self.client.counters)
        self.out.zero_()
        get_s, (found, _) = common.timed(lambda: self.client.get(tokens, out=self.out))
        if found != len(tokens):
            raise RuntimeError(f"get returned {found} of {len(tokens)} tokens")
        common.check_same(self.out, self.kv, f"get of prompt {prompt}")
        return {"s": get_s, **{name: self.client.counters[name] - before[name]
                               for name in ("remote_pages", "local_pages")}}

    def remote_get(self, prompt: int, control_prompt: int) -> dict:
        """A cold cross-node get; then, untimed, the wait until this node has pulled the pages
        the get read (off the get's path; waited for so it overlaps nothing that follows) and
        the get's control plane alone on `control_prompt` (one this node does not hold)."""
        pulled_before = self._pulled_pages()
        figures = self.get(prompt)
        start_s = time.perf_counter()
        while self._pulled_pages() < pulled_before + self.num_pages:
            if time.perf_counter() - start_s > PULL_TIMEOUT_S:
                raise RuntimeError(f"pages not pulled within {PULL_TIMEOUT_S:.0f} s")
            time.sleep(0.002)
        return {**figures, "adopt_s": time.perf_counter() - start_s,
                "control_s": self._control_s(control_prompt)}

    def _pulled_pages(self) -> int:
        return ray.get(self.client.local.stats())["pulled_pages"]

    def _control_s(self, prompt: int) -> float:
        """This node's acquire (a miss) and the directory's match, sent together, awaited."""
        client = self.client
        keys = self.keys_of(prompt)

        def both() -> None:
            acquired = client.local.acquire(client.geometry, keys)
            _, refs = client.directory.prefix_refs(keys)
            ray.get(refs + [acquired])

        return common.timed(both)[0]

    def replicate(self, prompt: int, source_node_id: str) -> dict:
        """The replication pull the control loop makes (this node's actor pulls the prompt's
        pages from the source node's page server into its host tier), timed until it returns:
        the pages are then resident here. Untimed after it: a get that must find every page
        on this node, with the bytes that were put. {"s", "pulled", "resident"}."""
        keys = self.keys_of(prompt)
        pull_s, pulled = common.timed(lambda: ray.get(self.client.local.pull(
            self.client.geometry, {source_node_id: keys})))
        return {"s": pull_s, "pulled": pulled, "resident": self.get(prompt)["local_pages"]}

    def dataplane_s(self, prompt: int, endpoint, transport: str | None = None) -> float:
        """The data plane alone: the owner's page server straight into `out`, no Ray call;
        over the client's transport, or the one named (nixl_vs_tcp reads with both)."""
        from cluster.core.dataplane.endpoint import PageRead
        from cluster.core.dataplane.transport import make_transport

        client = self.client
        keys = tuple(self.keys_of(prompt))
        self.out.zero_()
        if transport is not None and transport not in self.transports:
            self.transports[transport] = make_transport(transport)
        wire = client.view.transport if transport is None else self.transports[transport]
        read = PageRead(endpoint, client.geometry, keys, self._out_pages(),
                        client.view.authority)
        read_s, (count,) = common.timed(lambda: wire.read([read], 30.0))
        if count != len(keys):
            raise RuntimeError(f"the data plane read {count} of {len(keys)} pages")
        common.check_same(self.out, self.kv, f"data plane read of prompt {prompt}")
        return read_s

    def _out_pages(self):
        """out's page slices as a read's destinations: the layout a get fills."""
        from cluster.core.dataplane.endpoint import TensorPages
        from cluster.core.kvcheck import page_slices

        tokens = self.client.page_tokens
        return TensorPages(self.out, [self.out[:, :, :, page_slices(p, tokens)]
                                      for p in range(self.num_pages)])

    def nixl_up(self) -> str | None:
        """None once this process's NIXL agent is up (made in the background), else why not."""
        from cluster.core.dataplane.nixl_agent import shared_agent, unavailable_reason

        if shared_agent(wait_s=120.0) is not None:
            return None
        return unavailable_reason() or "the NIXL agent did not start within 120 s"

    def stream_s(self, address: tuple[str, int], num_lanes: int, into_rows: bool) -> float:
        """The raw TCP stream of the same pages over num_lanes connections, into a touched
        contiguous buffer, or (into_rows) into out's page slices: the layout a get fills."""
        if self.reader is None:
            self.reader = StreamReader(tuple(address), num_lanes)
        if into_rows:
            self.out.zero_()
            seconds = self.reader.read_s(self._out_pages())
            common.check_same(self.out, self.kv, "raw stream into out's rows")
            return seconds
        self.raw_out.fill(0)
        seconds = self.reader.read_s([(memoryview(page),) for page in self.raw_out])
        peers.check_pool(self.raw_out)
        return seconds

    def get_raw(self, refs: list) -> float:
        """ray.get of the pages (A -> B), then a copy of each into a touched buffer."""
        self.raw_out.fill(0)
        start_s = time.perf_counter()
        for index, page in enumerate(ray.get(refs)):
            np.copyto(self.raw_out[index], page)
        seconds = time.perf_counter() - start_s
        peers.check_pool(self.raw_out)
        return seconds

    def close_streams(self) -> None:
        for stream in (self.server, self.reader):
            if stream is not None:
                stream.close()
        self.server = self.reader = None
