"""raykv's router in front of Ray Serve LLM: requests carry text, and the router keys them as
RaykvConnector keys vLLM's pages (the model's tokenizer and geometry, blocks of 128)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from cluster.core.keys import page_keys
from cluster.core.spec import ModelSpec
from cluster.serving.model_dir import save_model_dir
from cluster.serving.prompt_keys import PromptKeys
from cluster.serving.vllm_app import router_settings


@dataclass
class Completion:
    prompt: object


@dataclass
class Chat:
    messages: list


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_dir(str(tmp_path_factory.mktemp("model") / "tiny-llama"), "tiny-llama")


def test_the_raykv_router_is_configured_from_the_model_dir(model_dir):
    # The engine's dtype and the running service's page size, as build_app passes them.
    router, kwargs = router_settings("raykv", model_dir, "tiny-llama", "team", "bfloat16", 256)
    assert router == "cluster.serving.router:RaykvRouter"
    spec = kwargs["prompt_keys"]["spec"]
    assert ModelSpec(**spec) == ModelSpec("tiny-llama", 2, 2, 16, "bfloat16")
    assert kwargs["prompt_keys"]["page_tokens"] == 256
    assert "renderer" not in kwargs["prompt_keys"]  # no engine arguments: the tokenizer's
    # Given the engine's arguments, it renders as the engine does (its connector left out).
    _, kwargs = router_settings("raykv", model_dir, "tiny-llama", "team", "bfloat16", 256,
                                engine_kwargs={"chat_template": "/t.jinja",
                                               "kv_transfer_config": {"kv_role": "kv_both"}})
    assert kwargs["prompt_keys"]["renderer"] == {
        "model_source": model_dir, "model_id": "tiny-llama",
        "engine_kwargs": {"chat_template": "/t.jinja"}}
    assert router_settings("pow2", model_dir, "m", "default", "float32", 256)[1] == {}
    with pytest.raises(ValueError, match="router"):
        router_settings("fastest", model_dir, "m", "default", "float32", 256)


def test_prompts_and_chats_are_keyed_like_the_connector(model_dir):
    spec = ModelSpec("tiny-llama", 2, 2, 16, "float32")
    keys = PromptKeys(model_dir, spec, "team", 128, secret=b"s" * 32)
    text = "x" * 300
    ids = keys.token_ids(Completion(text))
    assert ids == list(text.encode())  # the byte tokenizer: one id per byte
    assert keyed(keys, Completion(text)) == b"".join(page_keys(spec, "team", 128, ids,
                                                               b"s" * 32))
    assert len(keyed(keys, Completion([text]))) == 2 * 16  # two full pages
    chat = keys.token_ids(Chat([{"role": "user", "content": "y" * 200}]))
    assert bytes(chat).decode().startswith("user: yyy") and bytes(chat).decode().endswith(
        "assistant: ")
    assert keyed(keys, Completion("short")) == b""  # no full page
    assert keyed(keys, object()) == b""  # neither prompt nor messages
    assert keyed(keys, Completion(None)) == b""


def keyed(keys: PromptKeys, request: object) -> bytes:
    """The request's page keys as the router takes them (PromptKeys.request_ids, then keys)."""
    return keys.keys(asyncio.run(keys.request_ids(request)).token_ids)
