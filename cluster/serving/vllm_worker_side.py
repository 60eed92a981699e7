"""RaykvConnector's worker side (vLLM's model-runner process): the step's metadata from the
scheduler side, the worker's caches described by their strides, each step's loads (in the
step, or handed to the loader thread) and saves (copied out in the step, put in the
background), and the loads vLLM hears of as finished or failed. The data path itself is
cluster/serving/vllm_io.py; the connector and its scheduler side, vllm_connector.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.logger import init_logger

from cluster.serving.vllm_checks import probe_layout
from cluster.serving.vllm_io import KVMover
from cluster.serving.vllm_layout import (
    BlockLayout,
    CacheFormat,
    LayoutError,
    blocks_of,
    describe_worker,
    spec_mismatch,
)
from cluster.serving.vllm_plan import LoadSpec, SaveSpec
from cluster.serving.vllm_stats import RaykvWorkerOff

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

    from cluster.serving.vllm_service import ServiceLink

log = init_logger(__name__)  # vLLM's handlers: these lines land in the engine's log


@dataclass
class RaykvMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once a step: what to load in the background, what to save."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # How long the worker waits for saves (StepBudget.save_waits; None: not at all): for those
    # handed over in steps before (in start_load_kv), and for the step's own (wait_for_save).
    # Both run before the step's outputs.
    settle_before_s: float | None = None
    settle_after_s: float | None = None


class WorkerSide:
    """RaykvConnector's worker-side methods (a mixin of it: the connector's state and vLLM's
    metadata accessors are its own)."""

    _link: ServiceLink | None
    _block_size: int
    _mover: KVMover | None
    _layers: list[torch.Tensor]
    _layout: BlockLayout | None
    _failed_blocks: set[int]
    _unloaded: list[tuple[str, set[int]]]
    _loads_failed_in_step: bool  # a load in this step left blocks unfilled: no saves in it
    skipped_saves: int  # saves not made for that reason
    _worker_off: str | None  # why this worker turned itself off, until the scheduler is told

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe this worker's caches by their strides (any KVCacheLayout member, CPU or
        CUDA); caches raykv cannot move turn the connector off for this worker, with one log
        line, and the engine runs on without it."""
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.model_executor.models.utils import extract_layer_index

        if self._link is None:  # off (see why_off): never writes
            return
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
            self._worker_off = why  # told to the scheduler side (build_connector_worker_meta)
            return
        self._layers, self._layout = view, view.layout
        log.info("raykv connector: %d layers, %s %s, %d-token blocks, %s on %s",
                 view.layout.num_layers, view.layout.name, view.layout.interior.value,
                 view.layout.block_size, view.layout.dtype, view.device)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._loads_failed_in_step = False
        if not self.has_connector_metadata():
            return
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, RaykvMetadata):
            return
        mover = self._worker_mover()
        if mover is not None and metadata.settle_before_s is not None:
            mover.settle_saves(metadata.settle_before_s)  # the last step's, to the directory
        for spec in metadata.loads:
            in_step = spec.sync_timeout_s is not None
            if mover is None:  # no raykv here: a miss of every block, reported at once
                failed = blocks_of((spec.start, len(spec.token_ids)), spec.block_ids,
                                   self._block_size)
            elif in_step:  # before the forward reads the blocks; vLLM recomputes the misses
                failed = mover.load_now(spec)
            else:
                mover.start_load(spec)
                continue
            if in_step:
                self._failed_blocks |= failed
                self._loads_failed_in_step |= bool(failed)
            else:
                self._unloaded.append((spec.request_id, failed))

    def wait_for_layer_load(self, layer_name: str) -> None:
        # A load in the step finished in start_load_kv; the others finish before vLLM
        # schedules their request (get_finished).
        return

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
        if mover is not None and self._loads_failed_in_step:
            # This step's forward ran over blocks a load left unfilled: what it computed
            # after them is wrong until vLLM recomputes it (it learns of the blocks only after
            # this, from get_block_ids_with_load_errors), and a page once stored is never
            # replaced. Prefix caching can share a block between requests, so none of the
            # step's pages is saved: a future miss, never a wrong page.
            self.skipped_saves += len(metadata.saves)
            log.warning("raykv: a load in this step left blocks unfilled; not making the "
                        "step's %d saves", len(metadata.saves))
        elif mover is not None:  # no raykv: nothing saved, a future miss
            for spec in metadata.saves:
                mover.save(spec)
            if metadata.settle_after_s is not None:
                mover.settle_saves(metadata.settle_after_s)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        """The loads done since the last step; their unfilled blocks go to
        get_block_ids_with_load_errors, asked right after, in the same step."""
        done, self._unloaded = self._unloaded, []
        if self._mover is not None:
            done += self._mover.finished()
        for _, failed in done:
            self._failed_blocks |= failed
        return None, {request_id for request_id, _ in done} or None

    def build_connector_worker_meta(self) -> RaykvWorkerOff | None:
        """Once, after this worker turned itself off: why, for the scheduler side."""
        why, self._worker_off = self._worker_off, None
        return RaykvWorkerOff(why) if why else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _worker_mover(self) -> KVMover | None:
        """The mover, once raykv answers (never waiting for it: the step goes on)."""
        if self._mover is None and self._layers and self._link is not None:
            client = self._link.ready()
            if client is not None:
                self._mover = KVMover(client, self._layers, self._layout, self._link.spec,
                                      flush_saves=self._link.settings.save_mode != "async")
        return self._mover
