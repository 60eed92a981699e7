"""Page keys: one chained hash over full pages of tokens.

    ns      = H("raykv-ns-v2" | namespace secret | model geometry | namespace | page_tokens)
    key_0   = H(ns     | tokens[0:T])
    key_i   = H(key_i-1 | tokens[i*T:(i+1)*T])

A request whose KV depends on more than its tokens (a LoRA adapter, vLLM's cache_salt,
multimodal inputs) keys its pages under a salted root, so that it never shares them with a
request that differs in that:

    root'   = H(SALT_TAG | ns | extra)             KeyChain.salted(extra)

SALT_TAG is 16 bytes, as long as a key: a page key hashes a key followed by token bytes, so a
salted root can equal a page key only if some key were SALT_TAG. A chain can also continue
from any page: KeyChain.continued(key_i) keys tokens[(i+1)*T:] exactly as the full chain does,
so a save can put only the pages it adds.

The namespace secret (cluster/core/secrets.py) is a MAC of the namespace's name under the
service's master secret: without it no one can compute a tenant's keys, so no one can probe
whether a tenant holds a prefix. A running service always keys with it (a client gets its
namespace's secret from the controller when it connects); b"" is for tools and tests that key
pages offline.

H is blake3 truncated to 16 bytes over canonical bytes (tokens as little-endian uint32), so
every process and node computes the same keys regardless of PYTHONHASHSEED. Only full pages
are keyed; a trailing partial page has no key.

Two hashes, two jobs. blake3 (here) is the only hash that *names* anything in raykv: page keys,
namespaces, node-slot tags. A name must not collide across tenants and nodes, so it is a
cryptographic hash. The disk tier's per-page checksum (cluster/core/tiers/disk_format.py) is
xxh3-64: it only detects torn writes and flipped bits in bytes raykv wrote itself, runs over
every byte written and read, and a mismatch is merely a miss, so it takes the fastest good
checksum.
"""

from __future__ import annotations

import array as array_module
from dataclasses import dataclass
from typing import NewType

import blake3
import numpy as np

from cluster.core.spec import ModelSpec

PageKey = NewType("PageKey", bytes)
KEY_BYTES = 16
MAX_TOKEN_ID = 2**32 - 1
SALT_TAG = b"raykv-salt-v1|.."  # KEY_BYTES long; see the module docstring


def page_hash(*parts: bytes) -> PageKey:
    """The one hash: blake3 over the concatenated parts, 16-byte digest."""
    hasher = blake3.blake3()
    for part in parts:
        hasher.update(part)
    return PageKey(hasher.digest(KEY_BYTES))


def namespace_key(spec: ModelSpec, namespace: str, page_tokens: int,
                  secret: bytes = b"") -> PageKey:
    """The chain's root: the namespace's secret, model geometry, namespace and page size."""
    return page_hash(
        b"raykv-ns-v2|",
        len(secret).to_bytes(2, "little"),
        secret,
        spec.canonical_bytes(),
        b"|",
        namespace.encode(),
        b"|",
        str(page_tokens).encode(),
    )


def canonical_tokens(tokens: object) -> np.ndarray:
    """Validate token ids and return them as a contiguous little-endian uint32 array.

    Raises TypeError for non-integer tokens and ValueError for bad shapes or ranges.
    """
    array = _as_array(tokens)
    if array.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(array.shape)}")
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"tokens must be integers, got dtype {array.dtype}")
    if array.size and (int(array.min()) < 0 or int(array.max()) > MAX_TOKEN_ID):
        raise ValueError(f"token ids must lie in [0, {MAX_TOKEN_ID}]")
    return np.ascontiguousarray(array, dtype="<u4")


def _as_array(tokens: object) -> np.ndarray:
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # a torch tensor
        if getattr(tokens, "is_meta", False):
            raise TypeError("tokens is a tensor on the meta device: it holds no values")
        return tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        return tokens
    if isinstance(tokens, (list, tuple, range)):
        return _sequence_array(tokens)
    raise TypeError(f"tokens must be a list, numpy array or torch tensor, not {type(tokens)}")


def _sequence_array(tokens: list | tuple | range) -> np.ndarray:
    """A Python sequence of ints as int64.

    The fast path is array.array("q"), which takes ints (and numpy ints) in C and refuses
    floats, strings and nested sequences; bools, which it takes as 0 and 1, are looked for only
    where the array holds 0 or 1. Anything it refuses goes through the checked path, which
    names the problem.
    """
    if not len(tokens):
        return np.zeros(0, np.int64)
    try:
        array = np.frombuffer(array_module.array("q", tokens), dtype=np.int64)
    except (TypeError, OverflowError):
        return _checked_sequence_array(tokens)
    if any(type(tokens[i]) is bool for i in np.flatnonzero(array <= 1)):
        raise TypeError("tokens must be integers, got bool")
    return array


def _checked_sequence_array(tokens: list | tuple | range) -> np.ndarray:
    """The slow path: checked per type once rather than per token, with a clear error."""
    kinds = set(map(type, tokens))
    for kind in kinds:
        if issubclass(kind, (list, tuple, range, np.ndarray)):
            raise ValueError("tokens must be 1-D, got a nested sequence")
        if issubclass(kind, bool) or not issubclass(kind, (int, np.integer)):
            raise TypeError(f"tokens must be integers, got {kind.__name__}")
    try:
        return np.fromiter(tokens, dtype=np.int64, count=len(tokens))
    except OverflowError:
        raise ValueError(f"token ids must lie in [0, {MAX_TOKEN_ID}]") from None


def chain_keys(tokens: np.ndarray, root: PageKey, page_tokens: int) -> list[PageKey]:
    """Keys of the full pages of `tokens` (already canonical), chained from `root`.

    This runs once per page of every get and put, so it keeps one blake3 hasher and resets it
    for each page, feeding it the key before and the page's bytes: the same digest as
    page_hash(previous, page) (blake3 of their concatenation), without a new hasher object
    and a joined bytes object a page (0.40 against 0.65 us a page at 16-token pages, where a
    fresh page_hash costs about 1.1)."""
    num_pages = len(tokens) // page_tokens
    data = tokens[: num_pages * page_tokens].tobytes()
    stride = page_tokens * 4
    hasher = blake3.blake3()
    reset, update, digest = hasher.reset, hasher.update, hasher.digest
    keys: list[PageKey] = []
    append = keys.append
    previous = root
    for start in range(0, num_pages * stride, stride):
        reset()
        update(previous)
        update(data[start : start + stride])
        previous = digest(KEY_BYTES)
        append(previous)
    return keys


def page_keys(spec: ModelSpec, namespace: str, page_tokens: int, tokens: object,
              secret: bytes = b"") -> list[PageKey]:
    """Validate `tokens` and return the keys of their full pages."""
    return KeyChain.of(spec, namespace, page_tokens, secret).keys(tokens)


@dataclass(frozen=True, slots=True)
class KeyChain:
    """The keys of one model, namespace (with its secret) and page size: the root once."""

    page_tokens: int
    root: PageKey

    @staticmethod
    def of(spec: ModelSpec, namespace: str, page_tokens: int, secret: bytes = b"") -> KeyChain:
        if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or page_tokens <= 0:
            raise ValueError(f"page_tokens must be a positive int, got {page_tokens!r}")
        return KeyChain(page_tokens, namespace_key(spec, namespace, page_tokens, secret))

    def keys(self, tokens: object) -> list[PageKey]:
        """Validate `tokens` and return the keys of their full pages."""
        return chain_keys(canonical_tokens(tokens), self.root, self.page_tokens)

    def salted(self, extra: bytes) -> KeyChain:
        """The chain of the requests that `extra` sets apart (canonical bytes naming a LoRA
        adapter, a cache salt, multimodal inputs...): rooted in H(SALT_TAG | root | extra).
        b"" is this chain itself."""
        if not isinstance(extra, bytes):
            raise TypeError(f"extra must be bytes, got {type(extra).__name__}")
        if not extra:
            return self
        return KeyChain(self.page_tokens, page_hash(SALT_TAG, self.root, extra))

    def continued(self, key: PageKey) -> KeyChain:
        """The chain after the page whose key is `key`: its keys of tokens[k*T:] are the keys
        the full chain gives those pages when `key` is the key of page k-1."""
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes, got {key!r}")
        return KeyChain(self.page_tokens, PageKey(bytes(key)))


def shard_of(key: PageKey, num_shards: int) -> int:
    """Directory shard that owns `key` (keys are uniform hash bytes already)."""
    return int.from_bytes(key[:8], "little") % num_shards
