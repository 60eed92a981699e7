"""vLLM's CPU build binds its worker to its OpenMP cores (a worker process of its own, as `vllm
serve` and Ray Serve LLM run it); raykv's threads in that worker, and Ray's, run on the cores
left out (cluster/core/cpu_sets.py), not on the compute cores."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this "
                                   "tier in .venv-vllm")

import ray  # noqa: E402

from cluster import CacheConfig, ModelSpec, connect, start, stop  # noqa: E402
from cluster.core.tiers.memory import remove_stale_shm  # noqa: E402
from cluster.core.tiers.node_slot import slot_shm_prefix  # noqa: E402
from tests.vllm.conftest import prompt_tokens  # noqa: E402
from tests.vllm.engine import CONNECTOR, engine_on  # noqa: E402

BLOCK_TOKENS = 128
CPUS = set(os.sched_getaffinity(0))
# A worker process of its own, bound as `raykv bench vllm-serve` binds every engine (vLLM's
# default without a connector): one core reserved, the others OpenMP's.
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
# Threads Ray starts in a process at ray.init (their kernel names)
RAY_THREADS = {"worker.io", "gcs_client_io_s"}

pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs")


@pytest.fixture(scope="module")
def engine(model_dir):
    disk_dir = tempfile.mkdtemp(prefix="raykv-vllm-", dir="/tmp")
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
    start(CacheConfig(page_tokens=BLOCK_TOKENS, device_bytes=0, host_bytes=64 << 20,
                      disk_bytes=0, disk_dir=disk_dir, call_timeout_s=5.0))
    # The worker, a process outside Ray's, joins this cluster by its address: "auto" would
    # take the newest cluster on the machine, another test tier's when CI runs two at once.
    extra = {**CONNECTOR["kv_connector_extra_config"],
             "raykv.ray_address": ray.get_runtime_context().gcs_address}
    yield engine_on(None, model_dir, {**CONNECTOR, "kv_connector_extra_config": extra},
                    engine_kwargs={"max_model_len": 1024}, env=ENV)
    stop()
    ray.shutdown()
    remove_stale_shm(slot_shm_prefix(disk_dir))
    shutil.rmtree(disk_dir, ignore_errors=True)


def test_raykv_and_ray_threads_leave_the_cores_vllm_bound_its_worker_to(engine):
    prompt = prompt_tokens(4 * BLOCK_TOKENS, seed=1)
    ray.get(engine.generate.remote(prompt, 2))  # a save: the saver, committer, copies start
    client = connect(ModelSpec.preset("small-llama"))
    deadline_s = time.monotonic() + 30
    while client.lookup(prompt) < 3 * BLOCK_TOKENS:
        assert time.monotonic() < deadline_s, "the engine's save never reached raykv"
        time.sleep(0.2)
    (main_name, main_cpus), *threads = ray.get(engine.worker_thread_cpus.remote())
    bound = set(main_cpus)
    assert bound < CPUS, (main_name, main_cpus)  # vLLM bound its worker's thread
    spare = CPUS - bound
    ray_threads = {name: set(cpus) for name, cpus in threads if name in RAY_THREADS}
    assert ray_threads and all(cpus == spare for cpus in ray_threads.values()), threads
    # Python threads keep the process's name: raykv's (loader, saver, committer, touch
    # sender, copies) are those of that name off the bound cores; vLLM starts none there.
    python_off = [cpus for name, cpus in threads if name == main_name and set(cpus) == spare]
    assert len(python_off) >= 3, threads
