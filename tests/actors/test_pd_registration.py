"""RaykvPDBackend's registration reaches each Ray cluster's registry store, also from a
process that registered it in an earlier cluster (CI's test process did, and the next
cluster's P/D replicas shaped requests with Ray's default backend, which refused raykv's
router's kv_transfer_params)."""

from __future__ import annotations

import ray

from cluster.serving.vllm_pd import BACKEND_PATH, register_backend, registered_in_cluster


def _local_ray() -> None:
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="WARNING")


def test_each_cluster_gets_the_registration_this_process_made_in_an_earlier_one():
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import (
        KVConnectorBackendFactory,
    )

    try:
        _local_ray()
        assert not registered_in_cluster()
        register_backend()
        assert registered_in_cluster()
        register_backend()  # once there, kept
        assert registered_in_cluster()
        ray.shutdown()
        _local_ray()
        # This process's cache still names it; the new cluster's store does not hold it.
        assert KVConnectorBackendFactory.is_registered("RaykvConnector")
        assert not registered_in_cluster()
        register_backend()
        assert registered_in_cluster()
        # What a replica of this cluster resolves: the stored loader, not Ray's default.
        import ray.cloudpickle as pickle
        from ray.experimental.internal_kv import _internal_kv_get
        from ray.llm._internal.serve.utils.registry import _make_key
        loader = pickle.loads(_internal_kv_get(_make_key("kv_connector_backend",
                                                         "RaykvConnector")))
        assert f"{loader().__module__}:{loader().__name__}" == BACKEND_PATH
    finally:
        ray.shutdown()
