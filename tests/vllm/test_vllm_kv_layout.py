"""The connector's layouts against vLLM 0.32's own code: kv_layout's table is vLLM's
KVCacheLayout enum; caches allocated by vLLM's create_kv_cache_views in every member, for a GPU
backend (FlashAttention), MLA, fp8 and int8 with per-token-head scales, register with
RaykvConnector and round-trip through the connector's gather and scatter, landing where vLLM's
backends read them (FlashAttention's split, Triton's scale caches, the MLA latent); on vLLM's
CPU backend the probe runs vLLM's CPU cache op, and pages read back what that op wrote.

No engine and no Ray here: the attention backend the layers would run is stood in by
patching vLLM's get_current_attn_backends (there is no GPU to select FlashAttention on).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this "
                                   "tier in .venv-vllm")

import torch  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.triton_attn import (  # noqa: E402
    TritonAttentionBackend,
    TritonAttentionImpl,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    KVQuantMode,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from cluster.core.spec import ModelSpec  # noqa: E402
from cluster.serving import vllm_worker_side  # noqa: E402
from cluster.serving.vllm_connector import RaykvConnector  # noqa: E402
from cluster.serving.vllm_layout import blocks_to_kv, kv_to_blocks  # noqa: E402
from cluster.serving.vllm_service import spec_of  # noqa: E402

L, H, D, N, NUM_BLOCKS = 3, 2, 16, 16, 12
BLOCK_IDS = [11, 3, 7, 0, 9, 5, 1, 10, 2, 8]
RANGE = (5, 150)  # starts and ends inside a block
MEMBERS = list(KVCacheLayout)


def vllm_caches(layout: KVCacheLayout, spec, num_blocks: int = NUM_BLOCKS) -> dict:
    """One worker's caches as vLLM 0.32 allocates them for a single-group model: the
    KVCacheTensor strides of kv_cache_utils, the views of create_kv_cache_views (a dict in
    reverse layer order: the connector orders it)."""
    interleaved = L * spec.page_size_bytes if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, num_blocks, L, layout, fixed_strides=(None, interleaved, None, None, None))
    size = L * num_blocks * spec.page_size_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride,
                           block_stride=block_stride)
    views = create_kv_cache_views(torch.zeros(size, dtype=torch.int8), spec, num_blocks,
                                  layout, tensor)
    return dict(reversed(list(zip(names, views, strict=True))))


def registered(monkeypatch, backend, caches: dict, cache: SimpleNamespace,
               spec: ModelSpec) -> RaykvConnector:
    """A RaykvConnector's worker side (no service: none is needed to register) after
    register_kv_caches, its layers running `backend`. cache: cache_dtype, head_size, use_mla."""
    import vllm.distributed.kv_transfer.kv_connector.utils as connector_utils

    monkeypatch.setattr(connector_utils, "get_current_attn_backends",
                        lambda config, names=None: [backend])
    connector = RaykvConnector.__new__(RaykvConnector)
    connector._vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=cache.cache_dtype),
        model_config=SimpleNamespace(get_head_size=lambda: cache.head_size,
                                     use_mla=cache.use_mla))
    connector._link = SimpleNamespace(spec=spec)
    connector._block_size = next(iter(caches.values())).shape[2]
    connector._layers, connector._layout = [], None
    connector.register_kv_caches(caches)
    return connector


def by_layer(caches: dict) -> list[torch.Tensor]:
    return [caches[name] for name in sorted(caches)]


def token_slots(token_range, block_size: int):
    """(block id, slot in the block) tensors of each token in the range."""
    tokens = torch.arange(*token_range)
    return torch.tensor(BLOCK_IDS)[tokens // block_size], tokens % block_size


def round_trip(connector: RaykvConnector, kv: torch.Tensor) -> torch.Tensor:
    kv_to_blocks(kv, connector._layers, connector._layout, BLOCK_IDS, RANGE)
    out = torch.zeros_like(kv)
    blocks_to_kv(connector._layers, connector._layout, BLOCK_IDS, kv.shape[3], out)
    return out


def test_the_layout_table_is_vllms_enum():
    from cluster.core.kv_layout import LAYOUT_ORDERS

    assert LAYOUT_ORDERS == {member.name: member.value for member in KVCacheLayout}


@pytest.mark.parametrize("member", MEMBERS, ids=[m.name for m in MEMBERS])
def test_dense_strides_are_vllms(member):
    from cluster.core.kv_layout import order_strides

    spec = FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.int8)
    want = compute_layout_strides(spec, NUM_BLOCKS, L, member)  # bytes = int8 elements
    assert order_strides(member.value, (L, NUM_BLOCKS, H, N, 2 * D)) == want


@pytest.mark.parametrize("member", MEMBERS, ids=[m.name for m in MEMBERS])
def test_a_gpu_backends_caches_in_every_layout(monkeypatch, member):
    """FlashAttention's caches register (today's check_layers turns the connector off for
    NHD, the GPU default), and tokens land where FlashAttention reads them."""
    spec = FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    caches = vllm_caches(member, spec)
    connector = registered(monkeypatch, FlashAttentionBackend, caches,
                           SimpleNamespace(cache_dtype="auto", head_size=D, use_mla=False),
                           ModelSpec("m", L, H, D, "bfloat16"))
    assert connector._layers, "the connector turned itself off"
    kv = torch.randn(L, 2, H, len(BLOCK_IDS) * N, D).to(torch.bfloat16)
    out = round_trip(connector, kv)
    blocks, slots = token_slots(RANGE, N)
    for index, cache in enumerate(by_layer(caches)):
        key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)  # FlashAttention's
        assert torch.equal(key_cache[blocks, slots], kv[index, 0, :, slice(*RANGE)].transpose(0, 1))
        assert torch.equal(value_cache[blocks, slots],
                           kv[index, 1, :, slice(*RANGE)].transpose(0, 1))
    assert torch.equal(out[..., slice(*RANGE), :], kv[..., slice(*RANGE), :])


def test_mla_latents(monkeypatch):
    """One latent per token (no V): its halves are the page's two planes."""
    latent = 72
    spec = MLAAttentionSpec(block_size=N, num_kv_heads=1, head_size=latent, dtype=torch.bfloat16)
    caches = vllm_caches(KVCacheLayout.BLNHC, spec)
    model = SimpleNamespace(served_model_name="m", dtype=torch.bfloat16, use_mla=True,
                            get_num_layers=lambda parallel: L,
                            get_num_kv_heads=lambda parallel: 1, get_head_size=lambda: latent)
    config = SimpleNamespace(model_config=model, cache_config=SimpleNamespace(
        cache_dtype="auto"), parallel_config=SimpleNamespace(
        tensor_parallel_size=1, pipeline_parallel_size=1, rank=0))
    connector = registered(monkeypatch, FlashAttentionBackend, caches,
                           SimpleNamespace(cache_dtype="auto", head_size=latent, use_mla=True),
                           spec_of(config, None))  # the service's spec, as the connector's
    assert connector._layers
    kv = torch.randn(L, 2, 1, len(BLOCK_IDS) * N, latent // 2).to(torch.bfloat16)
    out = round_trip(connector, kv)
    blocks, slots = token_slots(RANGE, N)
    cache = by_layer(caches)[1]
    assert torch.equal(cache[blocks, 0, slots],
                       torch.cat([kv[1, 0, 0], kv[1, 1, 0]], dim=-1)[slice(*RANGE)])
    assert torch.equal(out[..., slice(*RANGE), :], kv[..., slice(*RANGE), :])


def test_int8_with_per_token_head_scales(monkeypatch):
    """Triton's int8_per_token_head cells, [K | K scale | V | V scale]: codes and fp32 scales
    land where Triton's own scale-cache views read them."""
    spec = TritonAttentionBackend.customize_spec(FullAttentionSpec(
        block_size=N, num_kv_heads=H, head_size=D, dtype=torch.int8,
        kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD))
    caches = vllm_caches(KVCacheLayout.LBNHC, spec)
    triton = SimpleNamespace(_k_scale_cache=None, _v_scale_cache=None,
                             _kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD)
    triton._ensure_scale_caches = lambda kv: TritonAttentionImpl._ensure_scale_caches(triton, kv)
    cache = by_layer(caches)[2]
    key_cache, _ = TritonAttentionImpl._pth_key_value_caches(triton, cache)  # fills scales
    connector = registered(monkeypatch, TritonAttentionBackend, caches,
                           SimpleNamespace(cache_dtype="int8_per_token_head", head_size=D,
                                           use_mla=False), ModelSpec("m", L, H, D + 4, "int8"))
    assert connector._layers
    kv = torch.randint(-128, 128, (L, 2, H, len(BLOCK_IDS) * N, D + 4), dtype=torch.int8)
    scales = torch.rand(L, 2, H, len(BLOCK_IDS) * N) + 0.5
    kv[..., D:] = scales.unsqueeze(-1).view(torch.int8)
    out = round_trip(connector, kv)
    blocks, slots = token_slots(RANGE, N)
    assert torch.equal(key_cache[blocks, slots][..., :D],
                       kv[2, 0, :, slice(*RANGE), :D].transpose(0, 1))
    assert torch.equal(triton._k_scale_cache[blocks, slots], scales[2, 0, :, slice(*RANGE)].T)
    assert torch.equal(triton._v_scale_cache[blocks, slots], scales[2, 1, :, slice(*RANGE)].T)
    assert torch.equal(out[..., slice(*RANGE), :], kv[..., slice(*RANGE), :])


def test_fp8_cache_bytes(monkeypatch):
    spec = FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.uint8)
    caches = vllm_caches(KVCacheLayout.BHLNC, spec)
    connector = registered(monkeypatch, FlashAttentionBackend, caches,
                           SimpleNamespace(cache_dtype="fp8_e5m2", head_size=D, use_mla=False),
                           ModelSpec("m", L, H, D, "fp8"))
    assert connector._layers
    kv = torch.randint(0, 256, (L, 2, H, len(BLOCK_IDS) * N, D), dtype=torch.uint8)
    out = round_trip(connector, kv.view(torch.float8_e4m3fn)).view(torch.uint8)
    assert torch.equal(out[..., slice(*RANGE), :], kv[..., slice(*RANGE), :])


class Lines:
    def __init__(self):
        self.lines = []

    def error(self, message, *args):
        self.lines.append(message % args)

    info = exception = warning = error


@pytest.mark.parametrize("cache_dtype", ["nvfp4", "turboquant_k8v4"])
def test_a_cache_it_cannot_move_turns_it_off_with_one_line(monkeypatch, cache_dtype):
    lines = Lines()
    monkeypatch.setattr(vllm_worker_side, "log", lines)  # the worker side's line
    spec = FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.uint8)
    connector = registered(monkeypatch, FlashAttentionBackend,
                           vllm_caches(KVCacheLayout.LBNHC, spec),
                           SimpleNamespace(cache_dtype=cache_dtype, head_size=D, use_mla=False),
                           ModelSpec("m", L, H, D, "fp8"))
    assert connector._layers == [] and connector._layout is None
    assert len(lines.lines) == 1 and cache_dtype in lines.lines[0]
    assert lines.lines[0].startswith("raykv connector off for this worker")


def test_the_cpu_backend_reads_back_what_vllms_cpu_op_wrote(monkeypatch):
    """vLLM's CPU backend: the probe runs vLLM's cache op; a page gathered from the blocks
    holds exactly what that op wrote into them (K transposed by the "vec" kernels)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from cluster.core.kv_layout import Interior

    block_size, head_dim = 32, 32  # the CPU kernels' block multiple and head size
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=H, head_size=head_dim,
                             dtype=torch.float32)
    caches = vllm_caches(KVCacheLayout.LBHNC, spec)
    connector = registered(monkeypatch, CPUAttentionBackend, caches,
                           SimpleNamespace(cache_dtype="auto", head_size=head_dim,
                                           use_mla=False),
                           ModelSpec("m", L, H, head_dim, "float32"))
    assert connector._layout.interior is Interior.CPU_KEY_TRANSPOSED
    num_tokens = 3 * block_size - 7
    keys = torch.randn(L, num_tokens, H, head_dim)
    values = torch.randn(L, num_tokens, H, head_dim)
    blocks, slots = token_slots((0, num_tokens), block_size)
    isa = _get_attn_isa(torch.float32, block_size, head_dim)
    for index, cache in enumerate(by_layer(caches)):
        key_cache, value_cache = cache.view(NUM_BLOCKS, H, 2 * block_size, head_dim).chunk(2, 2)
        ops.cpu_attn_reshape_and_cache(keys[index], values[index], key_cache, value_cache,
                                       blocks * block_size + slots, isa)
    out = torch.zeros(L, 2, H, num_tokens, head_dim)
    blocks_to_kv(connector._layers, connector._layout, BLOCK_IDS, num_tokens, out)
    assert torch.equal(out[:, 0], keys.transpose(1, 2))
    assert torch.equal(out[:, 1], values.transpose(1, 2))
