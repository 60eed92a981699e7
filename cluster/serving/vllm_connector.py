"""RaykvConnector: raykv as a vLLM KV connector (vLLM's KVConnectorBase_V1).

    KVTransferConfig(kv_connector="RaykvConnector",
                     kv_connector_module_path="cluster.serving.vllm_connector",
                     kv_role="kv_both",
                     kv_connector_extra_config={"raykv.namespace": "default",
                                                "raykv.ray_address": "auto",
                                                "raykv.model_name": "small-llama"})

Scheduler side (vLLM's engine-core process): one raykv lookup per request, through `prefetch`,
which also starts pulling pages held by other nodes toward this node while the request waits
for its step. The hit is cut to whole vLLM blocks. Worker side: the hit goes straight into the
request's paged blocks (cluster/serving/vllm_io.py), and each step's new full prompt pages are
saved in the background.

Pages are keyed by the model's geometry as vLLM runs it (layers, KV heads per worker, head
size, cache dtype), by `raykv.model_name` (default: vLLM's served model name) and by the
namespace, so raykv's own engine and client share them when they name the same model.

Every failure is a miss: no service means no hits, and a load that falls short reports its
blocks as invalid, which vLLM recomputes (this connector sets kv_load_failure_policy to
"recompute": a cache miss must never fail a request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from cluster.serving.vllm_io import KVMover
from cluster.serving.vllm_layout import (
    BlockLayout,
    CacheFormat,
    Interior,
    LayoutError,
    describe_worker,
    probed_interior,
    spec_mismatch,
)
from cluster.serving.vllm_plan import LoadSpec, NewRequest, RunningRequest, SaveSpec, StepPlanner
from cluster.serving.vllm_service import RaykvSettings, ServiceLink, spec_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = init_logger(__name__)  # vLLM's handlers: these lines land in the engine's log


@dataclass
class RaykvMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once a step: what to load before the forward, what to save after."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class RaykvConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by raykv; see the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # A raykv miss must be recomputed, never fail the request (vLLM's default is "fail");
        # the scheduler reads this right after creating its connector.
        self._kv_transfer_config.kv_load_failure_policy = "recompute"
        settings = RaykvSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self._link = ServiceLink(settings, spec_of(vllm_config, settings.model_name))
        self._block_size = vllm_config.cache_config.block_size
        self._planner: StepPlanner | None = None
        self._mover: KVMover | None = None
        self._layers: list[torch.Tensor] = []
        self._layout: BlockLayout | None = None
        self._failed_blocks: set[int] = set()
        self._link.client()  # connect while the engine starts, not on its first request

    # ---- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        planner = self._scheduler_planner()
        if planner is None:
            return 0, False
        hit = planner.hits.get(request.request_id)
        if hit is not None:  # asked again (waiting, or preempted): one lookup per request
            return planner.matched(request.request_id, num_computed_tokens, hit[1]), False
        prompt = list(request.prompt_token_ids or [])
        num_loadable = planner.loadable_tokens(len(prompt))
        if num_computed_tokens >= num_loadable:  # vLLM holds all raykv could give: no call
            return planner.matched(request.request_id, num_computed_tokens,
                                   num_computed_tokens), False
        num_cached = self._link.prefetch(prompt[:num_loadable])
        return planner.matched(request.request_id, num_computed_tokens, num_cached), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if self._planner is not None:
            self._planner.allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._planner is None:
            return RaykvMetadata()
        new = [NewRequest(r.req_id, list(r.prompt_token_ids), r.block_ids[0],
                          r.num_computed_tokens, scheduler_output.num_scheduled_tokens[r.req_id])
               for r in scheduler_output.scheduled_new_reqs if r.prompt_token_ids]
        cached = scheduler_output.scheduled_cached_reqs
        running = [RunningRequest(req_id, None if blocks is None else blocks[0],
                                  req_id in cached.resumed_req_ids,
                                  cached.num_computed_tokens[i],
                                  scheduler_output.num_scheduled_tokens[req_id])
                   for i, (req_id, blocks) in enumerate(zip(cached.req_ids,
                                                            cached.new_block_ids, strict=True))]
        loads, saves = self._planner.step(new, running)
        return RaykvMetadata(loads, saves)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._planner is not None:
            self._planner.finished(request.request_id)
        return False, None  # saves copy the blocks out in their step: free them now

    def _scheduler_planner(self) -> StepPlanner | None:
        """The planner, once the service answers (its page size is the service's)."""
        if self._planner is None:
            client = self._link.client()
            if client is not None:
                self._planner = StepPlanner(self._block_size, client.page_tokens)
        return self._planner

    # ---- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe this worker's caches by their strides (any KVCacheLayout member, CPU or
        CUDA); caches raykv cannot move turn the connector off for this worker, with one log
        line, and the engine runs on without it."""
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.model_executor.models.utils import extract_layer_index

        config, spec = self._vllm_config, self._link.spec  # KVConnectorBase_V1 keeps the config
        cache_format = CacheFormat(str(config.cache_config.cache_dtype),
                                   config.model_config.get_head_size(),
                                   bool(config.model_config.use_mla))
        try:
            # In layer order, whatever the dict's order: page layer i is the model's layer i.
            names = sorted(kv_caches, key=extract_layer_index)
            backends = {backend.get_name() for backend in get_current_attn_backends(config, names)}
            view = describe_worker([kv_caches[name] for name in names], cache_format, backends,
                                   probe_layout)
            why = spec_mismatch(view.layout, spec.page_shape(self._block_size),
                                spec.dtype_bytes)
        except LayoutError as error:
            view, why = None, str(error)
        except Exception as error:  # whatever it is, the engine runs on without raykv
            view, why = None, f"{type(error).__name__}: {error}"
        if why:
            log.error("raykv connector off for this worker: %s", why)
            self._layers, self._layout = [], None
            return
        self._layers, self._layout = view, view.layout
        log.info("raykv connector: %d layers, %s %s, %d-token blocks, %s on %s",
                 view.layout.num_layers, view.layout.name, view.layout.interior.value,
                 view.layout.block_size, view.layout.dtype, view.device)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, RaykvMetadata) or not metadata.loads:
            return
        mover = self._worker_mover()
        for spec in metadata.loads:
            if mover is None:
                self._failed_blocks |= set(spec.block_ids[spec.start // self._block_size:])
                continue
            self._failed_blocks |= mover.load(spec)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer: a raykv page spans them all

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # saved whole pages in wait_for_save, once every layer is computed

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, RaykvMetadata) or not metadata.saves:
            return
        mover = self._worker_mover()
        if mover is not None:
            for spec in metadata.saves:
                mover.save(spec)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        if self._mover is not None:
            self._mover.close()
            log.info("raykv connector: %s", self._mover.stats)

    def _worker_mover(self) -> KVMover | None:
        if self._mover is None and self._layers:
            client = self._link.client()
            if client is not None:
                self._mover = KVMover(client, self._layers, self._layout,
                                      self._link.spec.torch_dtype())
        return self._mover


def probe_layout(layer: torch.Tensor) -> Interior | None:
    """Where vLLM's CPU cache op puts K and V in a block like `layer`'s [blocks, H, B, C]: it
    writes one scratch block of distinct values, and the CPU interior that reads them back is
    the answer (None: none or both do, or the op is missing)."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        _, num_heads, block_size, cell = layer.shape
        head_dim = cell // 2
        scratch = torch.zeros((1, num_heads, block_size, cell), dtype=layer.dtype)
        keys, values = scratch.view(1, num_heads, 2 * block_size, head_dim).chunk(2, dim=2)
        known = (torch.arange(block_size * num_heads * head_dim) % 251 + 1).view(
            block_size, num_heads, head_dim).to(layer.dtype)
        ops.cpu_attn_reshape_and_cache(known, -known, keys, values, torch.arange(block_size),
                                       _get_attn_isa(layer.dtype, block_size, head_dim))
    except Exception:  # not vLLM's CPU backend, or its internals moved
        log.exception("could not probe vLLM's KV block layout")
        return None
    return probed_interior(scratch, known, -known)
