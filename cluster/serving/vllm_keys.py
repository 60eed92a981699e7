"""What a vLLM request's KV depends on besides its tokens and the model: the salt of its page
keys (KeyChain.salted). No vLLM import: requests are read by attribute.

    lora   the LoRA adapter, by the contents of its files (two names for one adapter share
           pages; two adapters never do), or by name and path when vLLM resolves it elsewhere
    salt   vLLM's cache_salt (a tenant's: its pages are its own)
    mm     each multimodal input's hash, modality and place in the prompt

A request with none of them keys as raykv's own engine does, and shares pages with it. A
prompt given as embeddings has no tokens to key: raykv neither loads nor saves it.
"""

from __future__ import annotations

import os

import blake3

FILE_CHUNK_BYTES = 8 << 20
_adapters: dict[tuple, bytes] = {}  # (path, files' names, sizes and mtimes) -> identity


def request_salt(request, epoch: bytes = b"") -> bytes | None:
    """Canonical bytes naming what sets `request`'s KV apart (b"" for nothing); None when
    raykv cannot key it. `epoch`: the engine's since its last cache reset (b"": none)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    fields: list[tuple[bytes, bytes]] = [(b"epoch", epoch)] if epoch else []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        fields.append((b"lora", adapter_identity(lora.lora_path or "", lora.lora_name or "")))
    cache_salt = getattr(request, "cache_salt", None)
    if cache_salt:
        fields.append((b"salt", str(cache_salt).encode()))
    inputs = [_canonical([(b"kind", str(f.modality).encode()),
                          (b"hash", str(f.mm_hash or f.identifier).encode()),
                          (b"at", f"{f.mm_position.offset}+{f.mm_position.length}".encode())])
              for f in getattr(request, "mm_features", None) or ()]
    if inputs:
        fields.append((b"mm", b"".join(inputs)))
    return _canonical(fields)


def is_plain(request) -> bool:
    """Whether nothing sets the request's KV apart (request_salt would be b""), checked
    without hashing anything: its pages are keyed as a router keys the prompt's text."""
    return (getattr(request, "prompt_embeds", None) is None
            and getattr(request, "lora_request", None) is None
            and not getattr(request, "cache_salt", None)
            and not getattr(request, "mm_features", None))


def adapter_identity(path: str, name: str) -> bytes:
    """A LoRA adapter's identity: blake3 of its directory's files (names, sizes, bytes),
    computed once per version of the files; its name and path when `path` is not a local
    directory."""
    if not path or not os.path.isdir(path):
        return _canonical([(b"name", name.encode()), (b"path", path.encode())])
    files = sorted((entry for entry in os.scandir(path)
                    if entry.is_file() and not entry.name.startswith(".")),
                   key=lambda entry: entry.name)
    version = (path, tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    identity = _adapters.get(version)
    if identity is None:
        hasher = blake3.blake3()
        for entry in files:
            hasher.update(_canonical([(b"file", entry.name.encode()),
                                      (b"size", str(entry.stat().st_size).encode())]))
            with open(entry.path, "rb") as handle:
                while chunk := handle.read(FILE_CHUNK_BYTES):
                    hasher.update(chunk)
        identity = b"files:" + hasher.digest(16)
        _adapters[version] = identity
    return identity


def _canonical(fields: list[tuple[bytes, bytes]]) -> bytes:
    """Tagged, length-prefixed fields: no two field lists give the same bytes."""
    return b"".join(tag + b"=" + len(value).to_bytes(8, "little") + value
                    for tag, value in fields)
