"""The disk tier's on-disk format: the page header, the slab manifest, and their checks.

    header block (4096 bytes, at the start of each slot), version 2:
        magic "RKVP" | version u16 | codec u16 | key[16] | payload_bytes u64 | xxh3(payload) u64
        | namespace length u16 | namespace (utf-8) | xxh3 of every byte before it u64
    version 1 (still read) has no namespace: its pages come back with namespace ""

A zeroed header (a freed slot's) has no magic: the slot reads as empty.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from cluster.core.tiers.aligned import write_private_text

MAGIC = b"RKVP"
FORMAT_VERSION = 1  # the slab layout, in manifest.json
HEADER_VERSION = 2  # the page header's: 2 adds the namespace
HEADER_BYTES = 4096
MAX_NAMESPACE_BYTES = 1024
MAX_CODEC = 0xFFFF
MANIFEST_NAME = "manifest.json"
_HEADER = struct.Struct("<4sHH16sQQ")  # magic, version, codec, key, payload_bytes, checksum
_NAMESPACE_LEN = struct.Struct("<H")  # version 2: then the namespace's utf-8 bytes
_HEADER_SUM = struct.Struct("<Q")  # xxh3 of every header byte before it, stored right after


@dataclass(frozen=True, slots=True)
class DiskPageMeta:
    key: bytes
    payload_bytes: int
    codec: int
    checksum: int  # xxh3_64 of the payload bytes
    namespace: str = ""  # whose page it is ("" from a version 1 header)


def checksum(data: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(data)


def payload_checksum(payload: np.ndarray, known: int | None = None) -> int:
    """A page's payload checksum: `known` when its owner computed it as the page was copied
    in (checksums_ahead.py), else computed now."""
    return checksum(payload) if known is None else known


def pack_header(header: np.ndarray, meta: DiskPageMeta) -> None:
    namespace = meta.namespace.encode()
    _HEADER.pack_into(header, 0, MAGIC, HEADER_VERSION, meta.codec, meta.key,
                      meta.payload_bytes, meta.checksum)
    _NAMESPACE_LEN.pack_into(header, _HEADER.size, len(namespace))
    end = _HEADER.size + _NAMESPACE_LEN.size + len(namespace)
    header[_HEADER.size + _NAMESPACE_LEN.size : end] = np.frombuffer(namespace, np.uint8)
    _HEADER_SUM.pack_into(header, end, checksum(header[:end]))


def parse_header(header: np.ndarray, max_payload_bytes: int) -> DiskPageMeta | None:
    """The page a header describes; None for an empty, foreign or corrupt one."""
    magic, version, codec, key, payload_bytes, payload_sum = _HEADER.unpack_from(header, 0)
    if magic != MAGIC or version not in (1, HEADER_VERSION):
        return None
    found = _unpack_namespace(header, version)
    if found is None:
        return None
    namespace, sum_at = found
    (header_sum,) = _HEADER_SUM.unpack_from(header, sum_at)
    if header_sum != checksum(header[:sum_at]) or payload_bytes > max_payload_bytes:
        return None
    return DiskPageMeta(key, payload_bytes, codec, payload_sum, namespace)


def _unpack_namespace(header: np.ndarray, version: int) -> tuple[str, int] | None:
    """(namespace, where the header's checksum sits), or None for a malformed one."""
    if version == 1:
        return "", _HEADER.size
    (length,) = _NAMESPACE_LEN.unpack_from(header, _HEADER.size)
    start = _HEADER.size + _NAMESPACE_LEN.size
    if length > MAX_NAMESPACE_BYTES:
        return None
    try:
        return bytes(header[start : start + length]).decode(), start + length
    except UnicodeDecodeError:
        return None


def ensure_manifest(dir_path: str, geometry: dict[str, int | str]) -> None:
    """Check the manifest against `geometry` (ValueError naming each mismatch), or write one."""
    path = os.path.join(dir_path, MANIFEST_NAME)
    if os.path.exists(path):
        try:
            with open(path) as file:
                found = json.load(file)
        except (OSError, ValueError) as error:
            raise ValueError(f"unreadable disk arena manifest {path}: {error}") from error
        mismatches = [f"{name}: on disk {found.get(name)!r}, asked for {wanted!r}"
                      for name, wanted in geometry.items() if found.get(name) != wanted]
        if mismatches:
            raise ValueError(f"disk arena geometry mismatch in {dir_path}: {'; '.join(mismatches)}")
        return
    stray = sorted(name for name in os.listdir(dir_path) if name.startswith("slab-"))
    if stray:
        raise ValueError(f"{dir_path} holds slab files {stray[:3]} but no {MANIFEST_NAME}")
    write_private_text(path, json.dumps(geometry, indent=2))


def check_namespace(namespace: str) -> None:
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
    if len(namespace.encode()) > MAX_NAMESPACE_BYTES:
        raise ValueError(f"namespace {namespace[:40]!r}... is over {MAX_NAMESPACE_BYTES} bytes")


def check_bytes(name: str, array: np.ndarray) -> None:
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8:
        raise TypeError(f"{name} must be a uint8 numpy array, got {type(array).__name__}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
