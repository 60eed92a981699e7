"""The directory's keys in Redis carry the cluster's key space: KubeRay's
RAY_external_storage_namespace (one per RayCluster, on a head with GCS fault tolerance), so
two clusters on one Redis keep apart (tests/cluster/test_failures.py drives it live)."""

from __future__ import annotations

from cluster.core.config import CacheConfig
from cluster.core.persist import directory_key_prefix


def test_the_key_space_defaults_to_kuberays_storage_namespace(monkeypatch):
    monkeypatch.setenv("RAY_external_storage_namespace", "2f6c-uid")
    assert CacheConfig().redis_key_space == "2f6c-uid"
    monkeypatch.delenv("RAY_external_storage_namespace")
    assert CacheConfig().redis_key_space == ""


def test_without_a_key_space_the_keys_are_the_ones_raykv_always_used():
    assert directory_key_prefix("raykv", "", 3) == "raykv:raykv:dir3"
    assert directory_key_prefix("raykv", "2f6c-uid", 3) == "raykv:raykv:2f6c-uid:dir3"
