"""vLLM's OnlineRenderer in raykv's router process, configured as the engine configures its
own: the engine's arguments go through Ray Serve LLM's engine-config path (the one its
LLMServer starts the engine from), and the frontend's chat template, template arguments and
tool settings come from the same arguments. engine_tokens.EngineTokens builds it.

Ray's KV-aware path builds the same renderer in its ingress, but Ray 2.60's module imports
`load_chat_template` from `vllm.entrypoints.chat_utils`, which vLLM 0.32 moved to
`vllm.renderers.chat_utils` (cluster/tools/bench/vllm_compat), so it cannot be imported
as is. This module imports it from where it is. It imports vLLM: only the router's process
loads it, on first need.
"""

from __future__ import annotations

from typing import Any


def load_chat_template(template: str | None):
    """vLLM's own loader (a path or the template's text), from wherever it is."""
    try:
        from vllm.renderers.chat_utils import load_chat_template as load
    except ImportError:  # a vLLM from before the move
        from vllm.entrypoints.chat_utils import load_chat_template as load
    return load(template)


class VllmRenderer:
    """Renders a request body (a dict) to the prompt ids its engine will prefill."""

    def __init__(self, spec: dict):
        """`spec`: engine_tokens.renderer_spec's (the model and the engine's arguments)."""
        from ray.llm._internal.serve.engines.vllm.vllm_engine import _get_vllm_engine_config
        from ray.serve.llm import LLMConfig
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
        from vllm.renderers import renderer_from_config
        from vllm.renderers.online_renderer import OnlineRenderer

        config = LLMConfig(model_loading_config={"model_id": spec["model_id"],
                                                 "model_source": spec["model_source"]},
                           engine_kwargs=dict(spec["engine_kwargs"]))
        frontend = FrontendArgs(**config.get_engine_config().frontend_kwargs)
        # The router runs on a CPU host whatever the engines run on, as Ray's ingress does.
        _, vllm_config = _get_vllm_engine_config(config, device_type="cpu")
        self.model_config = vllm_config.model_config
        self.renderer = OnlineRenderer(
            self.model_config, renderer_from_config(vllm_config), request_logger=None,
            chat_template=load_chat_template(frontend.chat_template),
            chat_template_content_format=frontend.chat_template_content_format,
            trust_request_chat_template=frontend.trust_request_chat_template,
            enable_auto_tools=frontend.enable_auto_tool_choice,
            exclude_tools_when_tool_choice_none=frontend.exclude_tools_when_tool_choice_none,
            tool_parser=frontend.tool_call_parser,
            default_chat_template_kwargs=frontend.default_chat_template_kwargs)

    async def tokenize(self, payload: dict) -> list[int] | None:
        """The prompt ids of a chat (`messages`) or of a completion of one text prompt; None
        for another body (a batch of prompts). Raises what the engine would refuse."""
        from ray.llm._internal.serve.core.configs.openai_api_models import (
            ChatCompletionRequest,
            CompletionRequest,
        )
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.renderers.inputs.preprocess import extract_prompt_components

        if "messages" in payload:
            request = ChatCompletionRequest.model_validate(_fields(payload,
                                                                   ChatCompletionRequest))
            rendered = await self.renderer.render_chat(request, skip_mm_cache=True)
            if isinstance(rendered, ErrorResponse):
                raise ValueError(rendered.error.message)
            inputs = rendered[1]
        elif isinstance(payload.get("prompt"), str):
            request = CompletionRequest.model_validate(_fields(payload, CompletionRequest))
            inputs = await self.renderer.preprocess_completion(
                request, prompt_input=request.prompt, prompt_embeds=None, skip_mm_cache=True)
        else:
            return None
        ids: list[int] = []
        for one in inputs:
            components = extract_prompt_components(self.model_config, one)
            ids.extend(components.token_ids or ())
        return ids


def _fields(payload: dict, model: Any) -> dict:
    """The body's fields the request model knows (a routing copy may carry others)."""
    return {k: v for k, v in payload.items() if k in model.model_fields}
