"""`make gpu-check` (cluster/tools/gpu_check.py) on this CPU machine: it imports nothing a
GPU machine may lack (Ray, vLLM, Redis, pydantic, blake3, xxhash), prints a SKIP line per
CUDA check and a JSON summary, and exits 0. Its cross-process logic runs here on the device
tier's CPU stand-in: a second process maps the chunks, and remaps after a regrant."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cluster.tools.gpu_check import (
    CUDA_CHECKS,
    Report,
    check_chunks_ipc,
    check_connector_layouts,
    check_regrant_remap,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ABSENT_ON_GPU_MACHINE = ("ray", "vllm", "redis", "pydantic", "blake3", "xxhash")
BLOCKER = f"""
import sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT_ON_GPU_MACHINE!r}:
            raise ImportError("not on the GPU machine: " + name)
sys.meta_path.insert(0, Absent())
"""


def run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300)


def test_gpu_check_runs_without_ray_and_skips_cleanly_without_cuda():
    result = run_python("import runpy; sys.argv = ['gpu_check']\n"
                        "runpy.run_module('cluster.tools.gpu_check', run_name='__main__')")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[:-1] == [f"SKIP {name}: no CUDA device here" for name in CUDA_CHECKS]
    summary = json.loads(lines[-1])
    assert summary["failed"] == 0 and set(summary["checks"].values()) == {"SKIP"}
    assert set(summary) == {"checks", "ratios", "figures", "failed"}


def test_the_package_imports_lazily_and_still_exports_its_api():
    result = run_python(
        "import cluster, cluster.core.tiers.memory, cluster.tools.gpu_check\n"
        "assert 'cluster.api' not in sys.modules and 'cluster.config' not in sys.modules\n"
        "print(sorted(cluster.__all__))")
    assert result.returncode == 0, result.stderr
    code = ("import sys\nfrom cluster import CacheConfig, ModelSpec, Quota, add_namespace, "
            "connect, purge, quotas, register_model, start, stop\nimport cluster\n"
            "assert start.__module__ == 'cluster.api' and cluster.CacheConfig is CacheConfig\n"
            "print(CacheConfig(device_bytes=0).device_bytes)")
    full = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO, timeout=300)
    assert full.returncode == 0 and full.stdout.strip() == "0", full.stderr
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        import cluster

        cluster.nope  # noqa: B018


def test_two_processes_share_the_stand_in_chunks_and_remap_after_a_regrant(capsys):
    report = Report()
    check_chunks_ipc(report, "cpu")
    check_regrant_remap(report, "cpu")
    assert report.summary()["checks"] == {"chunks_ipc[cpu]": "PASS",
                                          "regrant_remap[cpu]": "PASS"}, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "short last chunk 4194304 bytes at 33554432" in out
    assert "old allocation untouched: True" in out


def test_the_connector_layouts_check_runs_the_selfcheck_or_says_why_not(capsys):
    report = Report()
    check_connector_layouts(report, "cpu")
    try:
        import cluster.core.kv_layout_check  # noqa: F401
    except ImportError:
        assert capsys.readouterr().out == \
            "SKIP connector layouts: cluster.core.kv_layout_check not present\n"
        return
    assert report.checks and set(report.checks.values()) == {"PASS"}, capsys.readouterr().out


def test_on_a_mig_instance_the_peer_is_given_this_process_view(monkeypatch):
    """CUDA_VISIBLE_DEVICES names a MIG instance MIG-...: no GPU- UUID prefix selects it, so
    narrowing the peer by one would leave it no GPU and fail the IPC checks for nothing."""
    import cluster.tools.gpu_check as gpu_check

    mig = "MIG-4b1e7a2c-0000-5000-8000-00000000000a"
    monkeypatch.setattr(gpu_check, "local_gpu_uuids", lambda: ["GPU-4b1e7a2c-0000-5000"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mig)
    assert gpu_check.peer_visibility("cuda", -1) == (mig, ["GPU-4b1e7a2c-0000-5000"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gpu_check.peer_visibility("cuda", -1) == ("GPU-4b1e7a2c", ["GPU-4b1e7a2c-0000-5000"])
