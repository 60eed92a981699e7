"""Ray Serve LLM's prefill/decode disaggregation (`build_pd_openai_app`) over raykv.

    client -> ingress -> PDDecodeServer (decode engine) --1--> PDPrefillServer (prefill engine)
                               |                                   | its prompt's pages
                               | 2: local decode                   v
                               +-- RaykvConnector loads them <-- raykv (any node, any tier)

Ray's decode server orchestrates (its PDOrchestratorMixin): it shapes a prefill copy of the
request, runs it on a prefill replica up to its first (only) token, then runs the request on
its own engine with the kv_transfer_params the prefill returned. This module is the shaping
for RaykvConnector, a connector backend Ray picks by the connector's name:

  - prefill: Ray's producer params (`do_remote_decode`), one token, not streamed. The cut that
    raykv's router may have put on the client's request is dropped here: it was made for the
    decode replica (vllm_plan.decode_params puts it back on the decode request);
  - decode: the prefill's handoff ({"raykv_pd": {"tokens": ...}}), plus that cut.

The ids that raykv's router rendered as the engines do (engine_tokens.py) go to both sides
(a chat's in kv_transfer_params, a completion's as its prompt, which the copies keep), so
neither engine renders the prompt again.

Ray's default shaping would do the same but asserts that the client's request carries no
kv_transfer_params, which raykv's router sets for its cut. Nothing is pinned and no side
channel is opened: the prefill's connector saves the prompt's pages, the decode's waits for
them in raykv's directory (bounded by `raykv.pd_wait_s`) and loads them, from whichever node
and tier holds them; a prefix cached anywhere in raykv is loaded by either side.
"""

from __future__ import annotations

from typing import Any

from ray.llm._internal.serve.engines.vllm.kv_transfer.base import (
    BaseConnectorBackend,
    base_prefill_kv_transfer_params,
    clamp_request_to_single_token,
)

from cluster.serving.engine_tokens import with_forwarded_ids
from cluster.serving.vllm_plan import decode_params

CONNECTOR_NAME = "RaykvConnector"  # Ray Serve LLM picks a backend by the connector's name
BACKEND_PATH = "cluster.serving.vllm_pd:RaykvPDBackend"
REGISTRY_CATEGORY = "kv_connector_backend"  # Ray's registry of connector backends


class RaykvPDBackend(BaseConnectorBackend):
    """Ray Serve LLM's connector backend for RaykvConnector: sequential handoff, no peer
    binding (the decode learns what it needs from the prefill's response)."""

    requires_peer_binding = False
    concurrent_handoff = False

    def prepare_prefill_request(self, *, request: Any, peer: dict | None) -> Any:
        """A copy of the request that prefills the prompt for a remote decode."""
        prefill = request.model_copy(deep=True)
        prefill.kv_transfer_params = with_forwarded_ids(base_prefill_kv_transfer_params(),
                                                        request)
        clamp_request_to_single_token(prefill)
        return prefill

    def prepare_decode_request(self, *, request: Any, peer: dict | None,
                               prefill_response: Any) -> Any:
        """A copy of the request carrying the prefill's handoff and the router's cut."""
        decode = request.model_copy(deep=True)
        handoff = getattr(prefill_response, "kv_transfer_params", None)
        decode.kv_transfer_params = with_forwarded_ids(
            decode_params(handoff, getattr(request, "kv_transfer_params", None)), request)
        return decode


def register_backend() -> None:
    """Register RaykvPDBackend under the connector's name in this Ray cluster's registry (the
    GCS's KV store, which every process of the cluster reads); a registration already in this
    cluster's store is kept.

    Ray's registry also caches a name in the registering process, and then reports it
    registered even after that process has left for another cluster whose store lacks it (a
    driver that re-inits Ray, a test process): this cluster's replicas would then shape P/D
    requests with Ray's default backend, which refuses the kv_transfer_params that raykv's
    router sets. So the store itself is checked."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import (
        KVConnectorBackendFactory,
    )

    if registered_in_cluster():
        return
    if KVConnectorBackendFactory.is_registered(CONNECTOR_NAME):  # cached here, not stored there
        KVConnectorBackendFactory.unregister_backend(CONNECTOR_NAME)
    KVConnectorBackendFactory.register_backend(CONNECTOR_NAME, BACKEND_PATH)


def registered_in_cluster() -> bool:
    """Whether this Ray cluster's registry store holds RaykvPDBackend's registration."""
    from ray.experimental.internal_kv import _internal_kv_exists, _internal_kv_initialized
    from ray.llm._internal.serve.utils.registry import _make_key

    return _internal_kv_initialized() and bool(
        _internal_kv_exists(_make_key(REGISTRY_CATEGORY, CONNECTOR_NAME)))
