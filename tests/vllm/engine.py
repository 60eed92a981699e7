"""A vLLM engine living on a chosen Ray node, as a Serve LLM replica's engine would."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import ray

CONNECTOR = {"kv_connector": "RaykvConnector",
             "kv_connector_module_path": "cluster.serving.vllm_connector",
             "kv_role": "kv_both",
             "kv_connector_extra_config": {"raykv.model_name": "small-llama"}}
# In-process engine core: the connector runs in this actor, on its node, on its Ray connection.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


@ray.remote(num_cpus=1, max_restarts=0)
class Engine:
    def __init__(self, model_dir: str, connector: dict | None, engine_kwargs: dict | None = None):
        from vllm import LLM
        from vllm.config import KVTransferConfig

        transfer = KVTransferConfig(**connector) if connector else None
        kwargs = {"max_model_len": 4096, **(engine_kwargs or {})}
        self.llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, seed=0,
                       kv_transfer_config=transfer, **kwargs)
        self.num_preemptions = 0

    def generate(self, prompt: list[int], max_tokens: int, lora: tuple | None = None,
                 cache_salt: str | None = None) -> tuple[list[int], int]:
        """Greedy token ids, and the prompt tokens vLLM did not compute. `lora`: (name, id,
        path) of a LoRA adapter; `cache_salt`: vLLM's per-request cache salt."""
        ((ids, cached),) = self.generate_many([prompt], max_tokens, lora, cache_salt)
        return ids, cached

    def generate_many(self, prompts: list[list[int]], max_tokens: int,
                      lora: tuple | None = None,
                      cache_salt: str | None = None) -> list[tuple[list[int], int]]:
        """generate(), for several prompts scheduled together."""
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        inputs = [{"prompt_token_ids": prompt} | ({"cache_salt": cache_salt} if cache_salt
                                                  else {}) for prompt in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=False,
                                    lora_request=LoRARequest(*lora) if lora else None)
        return [(list(output.outputs[0].token_ids), output.num_cached_tokens or 0)
                for output in outputs]

    def generate_handing(self, prompt: list[int], max_tokens: int,
                         kv_transfer_params: dict | None) -> tuple[list[int], int, dict | None]:
        """generate() with the request's kv_transfer_params (as vLLM's OpenAI server passes
        them, in SamplingParams.extra_args); also the params the engine returned (P/D)."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                extra_args={"kv_transfer_params": kv_transfer_params})
        (output,) = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return (list(output.outputs[0].token_ids), output.num_cached_tokens or 0,
                output.kv_transfer_params)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def worker_stats(self) -> dict:
        """The worker-side connector's MoverStats, as a dict ({} before its first save)."""
        import dataclasses

        from vllm.distributed.kv_transfer import get_kv_transfer_group

        mover = get_kv_transfer_group()._mover
        return {} if mover is None else {f.name: getattr(mover.stats, f.name)
                                         for f in dataclasses.fields(mover.stats)}

    def worker_thread_cpus(self) -> list[tuple[str, list[int]]]:
        """(name, CPUs it may run on) of each thread of the engine's worker process (vLLM's
        "VLLM::Worker": its multiprocessing engine), the main thread first."""
        import os

        import psutil

        (worker,) = [child for child in psutil.Process().children(recursive=True)
                     if child.name().startswith("VLLM::Worker")]
        threads = sorted(thread.id for thread in worker.threads())
        threads.remove(worker.pid)
        return [(_thread_name(worker.pid, tid), sorted(os.sched_getaffinity(tid)))
                for tid in [worker.pid, *threads]]

    def scheduler_connector(self, path: str):
        """A dotted attribute of the scheduler's connector (None when it has none)."""
        value = self.llm.llm_engine.engine_core.engine_core.scheduler.connector
        for attribute in path.split("."):
            value = getattr(value, attribute, None)
        return value

    def reset_caches(self) -> bool:
        """vLLM's prefix cache and the connector's (reset_connector), as pause_generation(
        clear_cache=True) resets them around a weight update."""
        return self.llm.reset_prefix_cache(reset_connector=True)

    def worker_connector(self, path: str):
        """A dotted attribute of the worker's connector (None when it has none)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        value = get_kv_transfer_group()
        for attribute in path.split("."):
            value = getattr(value, attribute, None)
        return value

    def set_scheduler_connector(self, path: str, value) -> None:
        """Set a dotted attribute of the scheduler's connector (e.g. "_budget.mode")."""
        target = self.llm.llm_engine.engine_core.engine_core.scheduler.connector
        *owners, name = path.split(".")
        for attribute in owners:
            target = getattr(target, attribute)
        setattr(target, name, value)

    def fail_loads(self, count: int) -> None:
        """The worker's next `count` raykv loads fail (raise), as a fault would."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        mover = get_kv_transfer_group()._mover
        load, left = mover.load, [count]

        def failing(spec):
            if left[0] > 0:
                left[0] -= 1
                raise ConnectionError("injected fault")
            return load(spec)

        mover.load = failing

    def count_preemptions(self) -> None:
        """From now on, count the scheduler's preemptions in num_preemptions."""
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        preempt = scheduler._preempt_request

        def counted(*args, **kwargs):
            self.num_preemptions += 1
            return preempt(*args, **kwargs)

        scheduler._preempt_request = counted

    def preemptions(self) -> int:
        return self.num_preemptions


def _thread_name(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as comm:
            return comm.read().strip()
    except OSError:  # gone since
        return ""


def engine_on(resource: str | None, model_dir: str, connector: dict | None = CONNECTOR,
              engine_kwargs: dict | None = None, env: dict | None = None):
    """An Engine on the node that offers `resource` (None: anywhere), started (its model
    loaded); `env`: more of the engine's environment variables."""
    options = {"runtime_env": {"env_vars": {**ENGINE_ENV, **(env or {})}}}
    if resource is not None:
        options["resources"] = {resource: 1}
    engine = Engine.options(**options).remote(model_dir, connector, engine_kwargs)
    ray.get(engine.node.remote())
    return engine


@contextmanager
def served_engine(model_dir: str, page_tokens: int, engine_kwargs: dict) -> Iterator:
    """A local Ray with raykv (host tier only, `page_tokens` a page) and one engine with the
    connector on it; all of it gone after."""
    from cluster import CacheConfig, start, stop
    from cluster.core.tiers.memory import remove_stale_shm
    from cluster.core.tiers.node_slot import slot_shm_prefix

    disk_dir = tempfile.mkdtemp(prefix="raykv-vllm-", dir="/tmp")
    ray.init(address="local", num_cpus=4, resources={"kv_node": 1}, include_dashboard=False,
             logging_level="WARNING")
    try:
        start(CacheConfig(page_tokens=page_tokens, device_bytes=0, host_bytes=64 << 20,
                          disk_bytes=0, disk_dir=disk_dir, call_timeout_s=5.0))
        yield engine_on(None, model_dir, engine_kwargs=engine_kwargs)
        stop()
    finally:
        ray.shutdown()
        remove_stale_shm(slot_shm_prefix(disk_dir))
        shutil.rmtree(disk_dir, ignore_errors=True)
