"""A replica's vLLM KV events, served to raykv's routers behind ZMQ CURVE.

Why: vLLM's publisher (ZmqEventPublisher) has no authentication, and its events carry the token
ids of every prompt its engine caches. Whoever reaches its port reads every tenant's prompts,
and its replay socket hands over the whole buffer on request. So a raykv replica has vLLM
publish on ipc sockets in a directory only this user may enter, and relays them on TCP sockets
that encrypt every frame and admit one client key only:

    vLLM PUB    ipc://<private dir>/events  ->  SUB     relay  PUB    tcp://<node>:<port>
    vLLM ROUTER ipc://<private dir>/replay  <-> DEALER  relay  ROUTER tcp://<node>:<port>

Both TCP sockets are CURVE servers; ZAP (pyzmq's ThreadAuthenticator) admits the reader key
alone. The keys are made fresh when the replica starts: one pair for the relay, one for its
readers. The replica advertises the relay's public key and the readers' pair in its routing
stats, which reach routers over Ray, whose token authenticates every call: one who can read
them could call the replica itself.

The relay is one thread that only moves frames. A replay request goes on to vLLM as it came
(vLLM's ROUTER takes exactly [identity, b"", start], so the relay keeps the readers' identities
itself and answers each in turn); vLLM answers requests in order, ending each with END_SEQ.

pyzmq comes with vLLM: this module is imported only where vLLM replicas publish events.
"""

from __future__ import annotations

import collections
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("raykv.vllm")
ZAP_DOMAIN = "raykv-engine-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_MS = 50  # how soon the thread sees a stop
REPLAY_ANSWER_S = 10.0  # a replay vLLM has not finished answering by then is given up
MAX_FRAMES_PER_TURN = 512
HWM = 100_000  # vLLM's own publisher's


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """What a reader needs (z85 text): the relay's public key and the readers' key pair."""

    server_key: str
    public_key: str
    secret_key: str

    @staticmethod
    def make() -> tuple[CurveKeys, bytes]:
        """(the readers' keys, the relay's own secret key), all fresh."""
        server_public, server_secret = zmq.curve_keypair()
        public, secret = zmq.curve_keypair()
        return CurveKeys(server_public.decode(), public.decode(), secret.decode()), server_secret

    @staticmethod
    def of(advertised: Mapping | None) -> CurveKeys | None:
        if not advertised:
            return None
        return CurveKeys(str(advertised["server_key"]), str(advertised["public_key"]),
                         str(advertised["secret_key"]))

    def advertised(self) -> dict:
        return {"server_key": self.server_key, "public_key": self.public_key,
                "secret_key": self.secret_key}

    def apply(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE client of the relay (before it connects)."""
        sock.curve_secretkey = self.secret_key.encode()
        sock.curve_publickey = self.public_key.encode()
        sock.curve_serverkey = self.server_key.encode()


class _OneKey:
    """ZAP's CURVE check: the readers' public key, and no other."""

    def __init__(self, public_key: str):
        self._key = public_key.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == ZAP_DOMAIN and key == self._key


def private_endpoints() -> tuple[str, str, str]:
    """(a fresh 0700 directory of this user's, vLLM's events endpoint, its replay endpoint)
    in it: ipc sockets there can be opened by this user only."""
    directory = tempfile.mkdtemp(prefix="raykv-events-")  # 0700, a name no one else made
    return directory, f"ipc://{directory}/events", f"ipc://{directory}/replay"


class EventsRelay:
    """vLLM's events from `events_in` (and replays from `replay_in`) relayed on TCP ports the
    OS picks at `host`, behind CURVE (module docstring). `endpoint`, `replay_endpoint` and
    `keys` are what readers need; `close` stops it and removes `private_dir` if given."""

    def __init__(self, events_in: str, replay_in: str | None, host: str,
                 private_dir: str | None = None):
        self.keys, server_secret = CurveKeys.make()
        self._private_dir = private_dir
        self._context = zmq.Context()
        self._auth = ThreadAuthenticator(self._context)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, _OneKey(self.keys.public_key))
        self._sub = self._pub = self._front = self._back = None
        try:
            self._open(events_in, replay_in, host, server_secret)
        except BaseException:
            self._auth.stop()
            self._context.destroy(linger=0)
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raykv-events-relay",
                                        daemon=True)
        self._thread.start()

    def _open(self, events_in: str, replay_in: str | None, host: str,
              server_secret: bytes) -> None:
        self._sub = self._context.socket(zmq.SUB)
        self._sub.linger = 0
        self._sub.rcvhwm = HWM
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(events_in)
        self._pub = self._server(zmq.PUB, server_secret)
        self._pub.sndhwm = HWM
        self.endpoint = _bind(self._pub, host)
        self._replay_in = replay_in
        self.replay_endpoint = None
        if replay_in:
            self._front = self._server(zmq.ROUTER, server_secret)
            self.replay_endpoint = _bind(self._front, host)
            self._back = self._dealer()

    def advertised(self, epoch: str) -> dict:
        """What the replica's routing stats tell routers."""
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "epoch": epoch, "curve": self.keys.advertised()}

    @property
    def alive(self) -> bool:
        """Whether it still relays (its thread stops on close, or on an error it logged)."""
        return self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._auth.stop()
        self._context.term()  # the thread closed its sockets
        if self._private_dir:
            shutil.rmtree(self._private_dir, ignore_errors=True)

    def _server(self, kind: int, server_secret: bytes) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.linger = 0
        sock.curve_server = True
        sock.curve_secretkey = server_secret
        sock.zap_domain = ZAP_DOMAIN.encode()
        return sock

    def _dealer(self) -> zmq.Socket:
        sock = self._context.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(self._replay_in)
        return sock

    def _run(self) -> None:
        # The sockets are this thread's from here on (made before it started, used only here).
        waiting: collections.deque[tuple[bytes, float]] = collections.deque()
        try:
            while not self._stop.is_set():
                poller = zmq.Poller()
                for sock in (self._sub, self._front, self._back):
                    if sock is not None:
                        poller.register(sock, zmq.POLLIN)
                ready = dict(poller.poll(POLL_MS))
                if self._sub in ready:
                    self._forward_events()
                if self._front is not None:
                    self._serve_replays(ready, waiting)
        except Exception:  # readers then miss events, which their replays cannot fill
            log.exception("the KV events relay stopped")
        finally:
            for sock in (self._sub, self._pub, self._front, self._back):
                if sock is not None:
                    sock.close(linger=0)

    def _forward_events(self) -> None:
        for _ in range(MAX_FRAMES_PER_TURN):
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._pub.send_multipart(frames, copy=False)

    def _serve_replays(self, ready: dict, waiting: collections.deque) -> None:
        if self._front in ready:
            for _ in range(MAX_FRAMES_PER_TURN):
                try:
                    identity, *request = self._front.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(request) != 2 or request[0] != b"" or len(request[1]) != 8:
                    continue
                try:  # never blocks the relay: a request vLLM cannot take now is dropped,
                    # and its reader's replay times out (a failed replay, which it handles)
                    self._back.send_multipart(request, zmq.NOBLOCK)
                except zmq.Again:
                    continue
                waiting.append((identity, time.monotonic() + REPLAY_ANSWER_S))
        if self._back in ready:
            for _ in range(MAX_FRAMES_PER_TURN):
                try:
                    answer = self._back.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if waiting:  # a reader gone meanwhile: its ROUTER drops the frames
                    self._front.send_multipart((waiting[0][0], *answer))
                    if len(answer) >= 3 and answer[2] == END_SEQ:
                        waiting.popleft()
        if waiting and time.monotonic() > waiting[0][1]:
            # vLLM did not finish answering: answers still coming would go to the wrong
            # reader. A new socket to it, and the waiting readers time out on their own.
            log.warning("vLLM did not answer %d KV event replay(s) in %.0f s", len(waiting),
                        REPLAY_ANSWER_S)
            waiting.clear()
            self._back.close(linger=0)
            self._back = self._dealer()


def _bind(sock: zmq.Socket, host: str) -> str:
    """Bind `sock` at `host` on a port the OS picks; the endpoint readers connect to."""
    if ":" in host:  # an IPv6 address
        sock.ipv6 = True
        host = f"[{host}]"
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"
