"""Validation of KV tensors at the client boundary: a bad input is refused before anything is
stored, with an error that names the problem."""

from __future__ import annotations

import torch

from cluster.core.spec import ModelSpec


def page_slices(page: int, page_tokens: int) -> slice:
    return slice(page * page_tokens, (page + 1) * page_tokens)


def page_rows(kv: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """kv [L, 2, H, N, D] as its whole pages, [L, 2, H, N // page_tokens, page_tokens, D]: a
    view, so rows[:, :, :, p:p+k] are pages p..p+k-1 of kv, written in place."""
    num_pages = kv.shape[3] // page_tokens
    return kv[:, :, :, : num_pages * page_tokens].unflatten(3, (num_pages, page_tokens))


def slab_order(block: torch.Tensor) -> torch.Tensor:
    """k pages as slots hold them, [k, L, 2, H, T, D], viewed in page_rows' order
    [L, 2, H, k, T, D] (no copy)."""
    return block.permute(1, 2, 3, 0, 4, 5)


KV_DEVICES = ("cpu", "cuda")  # where raykv's copies can read and write a KV tensor


def _check_layout(kv: object, spec: ModelSpec, what: str) -> None:
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(kv).__name__}")
    if kv.device.type not in KV_DEVICES:
        raise TypeError(f"{what} is on device {str(kv.device)!r}; raykv copies KV to and from "
                        f"CPU or CUDA tensors only")
    if kv.dtype != spec.torch_dtype():
        raise TypeError(f"{what} dtype {kv.dtype} does not match model {spec.name!r} "
                        f"dtype {spec.torch_dtype()}")
    expected = (spec.num_layers, 2, spec.num_kv_heads, None, spec.head_dim)
    shape = tuple(kv.shape)
    wrong = len(shape) != 5 or any(
        e is not None and e != s for e, s in zip(expected, shape, strict=True))
    if wrong:
        raise ValueError(f"{what} shape {shape} is not [num_layers={spec.num_layers}, 2, "
                         f"num_kv_heads={spec.num_kv_heads}, num_tokens, "
                         f"head_dim={spec.head_dim}]")


def check_kv(kv: object, spec: ModelSpec, num_tokens: int) -> None:
    """kv must be [num_layers, 2, num_kv_heads, num_tokens, head_dim] in the model's dtype."""
    _check_layout(kv, spec, "kv")
    if kv.shape[3] != num_tokens:
        raise ValueError(f"kv holds {kv.shape[3]} tokens but tokens has {num_tokens}")


def check_out(out: object, spec: ModelSpec, num_tokens: int, page_tokens: int) -> None:
    """out must have the KV layout and room for every full page of the tokens."""
    _check_layout(out, spec, "out")
    needed = num_tokens // page_tokens * page_tokens
    if out.shape[3] < needed:
        raise ValueError(f"out has room for {out.shape[3]} tokens; the full pages of tokens "
                         f"need {needed}")
