"""The autoscaler's side of scaling: ask for kv nodes, and read the request back.

`ray.autoscaler.sdk.request_resources(bundles=...)` records a standing request in the GCS:
autoscaler v1 reads it from the internal KV (`AUTOSCALER_RESOURCE_REQUEST_CHANNEL`), v2 from the
GCS's cluster resource constraints. Either way it is a floor the autoscaler keeps until the
next request replaces it. Both calls block on the GCS: actors run them in a thread.
"""

from __future__ import annotations

import json


def request_bundles(bundles: list[dict[str, float]]) -> None:
    """Replace the standing request with `bundles` ([] withdraws it)."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=list(bundles))


def requested_bundles() -> list[dict[str, float]]:
    """The standing request, one dict per bundle ([] when there is none)."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    if is_autoscaler_v2():
        return _requested_v2()
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


def _requested_v2() -> list[dict[str, float]]:
    from ray.autoscaler.v2.sdk import get_cluster_resource_state
    from ray.experimental.internal_kv import internal_kv_get_gcs_client

    state = get_cluster_resource_state(internal_kv_get_gcs_client())
    bundles = []
    for constraint in state.cluster_resource_constraints:
        for request in constraint.resource_requests:
            shape = dict(request.request.resources_bundle)
            bundles += [shape] * request.count
    return bundles

