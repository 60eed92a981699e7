"""A vLLM engine living on a chosen Ray node, as a Serve LLM replica's engine would."""

from __future__ import annotations

import ray

CONNECTOR = {"kv_connector": "RaykvConnector",
             "kv_connector_module_path": "cluster.serving.vllm_connector",
             "kv_role": "kv_both",
             "kv_connector_extra_config": {"raykv.model_name": "small-llama"}}
# In-process engine core: the connector runs in this actor, on its node, on its Ray connection.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


@ray.remote(num_cpus=1, max_restarts=0)
class Engine:
    def __init__(self, model_dir: str, connector: dict | None):
        from vllm import LLM
        from vllm.config import KVTransferConfig

        transfer = KVTransferConfig(**connector) if connector else None
        self.llm = LLM(model=model_dir, dtype="float32", enforce_eager=True,
                       max_model_len=4096, seed=0, kv_transfer_config=transfer)

    def generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
        """Greedy token ids, and the prompt tokens vLLM did not compute."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        (output,) = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return list(output.outputs[0].token_ids), output.num_cached_tokens or 0

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def engine_on(resource: str, model_dir: str, connector: dict | None = CONNECTOR):
    """An Engine on the node that offers `resource`, started (its model loaded)."""
    engine = Engine.options(resources={resource: 1},
                            runtime_env={"env_vars": ENGINE_ENV}).remote(model_dir, connector)
    ray.get(engine.node.remote())
    return engine
