"""raykv's router renders a request as its vLLM engine will (cluster/serving/engine_tokens.py),
keys the pages from those ids and hands a chat's ids to the engine, which then renders
nothing again. The renderer here is a fake; tests/vllm/test_serve_app.py checks vLLM's own
against the engine's."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from pydantic import BaseModel
from ray.serve._private.common import RequestMetadata
from ray.serve._private.request_router.common import PendingRequest

from cluster.core.keys import KeyChain
from cluster.core.spec import ModelSpec
from cluster.serving import engine_tokens
from cluster.serving.engine_tokens import (
    FORWARD_KEY,
    EngineTokens,
    client_token_ids,
    forward,
    forwardable,
    payload_of,
    renderer_spec,
    with_forwarded_ids,
)
from cluster.serving.prompt_keys import PromptKeys
from cluster.serving.vllm_plan import HIT_KEY
from tests.unit.test_engine_routing import (
    PAGE,
    SPEC,
    AsyncFakeDirectory,
    Follower,
    ids,
    make_router,
)

SECRET = b"s" * 32
CHAIN = KeyChain.of(ModelSpec(**SPEC), "default", PAGE, SECRET)
RENDERED = [(i * 7 + 3) % 500 for i in range(3 * PAGE + 5)]  # the engine's ids for any chat


class FakeTokenizer:
    """Ray's kv_aware Tokenizer's shape: async tokenize(payload) -> ids."""

    def __init__(self, ids=RENDERED, error: Exception | None = None):
        self.ids, self.error = ids, error
        self.payloads: list[dict] = []

    async def tokenize(self, payload: dict):
        self.payloads.append(payload)
        if self.error is not None:
            raise self.error
        return self.ids


def chat(**fields):
    return SimpleNamespace(**{"messages": [{"role": "user", "content": "hello"}],
                              "kv_transfer_params": None, **fields})


def test_the_renderer_gets_the_engine_s_arguments_less_the_connector_and_events():
    spec = renderer_spec("/models/m", "m", {"chat_template": "/t.jinja", "dtype": "float32",
                                            "kv_transfer_config": {"kv_connector": "X"},
                                            "kv_events_config": {"publisher": "zmq"}})
    assert spec == {"model_source": "/models/m", "model_id": "m",
                    "engine_kwargs": {"chat_template": "/t.jinja", "dtype": "float32"}}
    # Serve takes a router's kwargs as JSON only: without them, the tokenizer's own template.
    assert renderer_spec("/models/m", "m", {"hf_overrides": object()}) is None


def completion(**fields):
    return SimpleNamespace(**{"prompt": "some text", "kv_transfer_params": None, "echo": False,
                              "prompt_embeds": None, **fields})


def test_a_chat_of_one_conversation_and_a_completion_of_one_text_are_handed_over():
    assert forwardable(chat())
    assert forwardable(completion())
    assert not forwardable(SimpleNamespace(messages=[[{"role": "user", "content": "a"}]],
                                           kv_transfer_params=None))  # vLLM refuses a batch
    assert not forwardable(completion(echo=True))  # its reply carries the prompt's text
    assert not forwardable(completion(prompt=["a", "b"]))  # a batch
    assert not forwardable(completion(prompt=[1, 2]))  # ids already
    assert not forwardable(completion(prompt_embeds=b"x"))
    # A tokenize request carries messages but no kv_transfer_params (pydantic would refuse
    # the new field): nothing to hand over.
    assert not forwardable(SimpleNamespace(messages=[{"role": "user", "content": "a"}]))


def test_a_client_s_own_ids_are_kept_and_bad_ones_are_not_taken():
    assert client_token_ids(chat(kv_transfer_params={FORWARD_KEY: [5, 6]})) == [5, 6]
    assert client_token_ids(completion(prompt=[5, 6])) == [5, 6]  # a prompt of ids
    assert client_token_ids(completion()) is None
    for bad in ([], [1, -2], [True, 1], "12", [1.0]):
        assert client_token_ids(chat(kv_transfer_params={FORWARD_KEY: bad})) is None
        assert client_token_ids(completion(prompt=bad)) is None
    request = chat(kv_transfer_params={FORWARD_KEY: [5, 6], HIT_KEY: 32})
    forward(request, [1, 2, 3])
    assert request.kv_transfer_params == {FORWARD_KEY: [5, 6], HIT_KEY: 32}
    request = chat(kv_transfer_params={HIT_KEY: 32})
    forward(request, [1, 2, 3])
    assert request.kv_transfer_params == {HIT_KEY: 32, FORWARD_KEY: [1, 2, 3]}
    request = completion(kv_transfer_params={HIT_KEY: 32})
    forward(request, [1, 2, 3])  # vLLM reads a completion's ids only as its prompt
    assert request.prompt == [1, 2, 3] and request.kv_transfer_params == {HIT_KEY: 32}


def test_a_copy_for_another_engine_keeps_the_handed_over_ids():
    """P/D (vllm_pd.py): the prefill's and the decode's params get the chat's ids too."""
    request = chat(kv_transfer_params={FORWARD_KEY: [7, 8], HIT_KEY: 32})
    assert with_forwarded_ids({"do_remote_decode": True}, request) == {
        "do_remote_decode": True, FORWARD_KEY: [7, 8]}
    assert with_forwarded_ids(None, request) == {FORWARD_KEY: [7, 8]}
    assert with_forwarded_ids({"a": 1}, chat()) == {"a": 1}  # none handed over
    # A completion's ids are its prompt, which the copy keeps.
    assert with_forwarded_ids(None, completion(prompt=[7])) is None


def test_the_payload_is_the_body_as_the_client_set_it():
    class Body(BaseModel):
        model: str
        temperature: float = 1.0

    assert payload_of(Body(model="m")) == {"model": "m"}  # defaults left to re-validation
    assert payload_of(SimpleNamespace(model="m", stream=False)) == {"model": "m",
                                                                    "stream": False}
    assert payload_of({"model": "m"}) == {"model": "m"}
    assert payload_of(3) is None


async def rendered(tokens: EngineTokens, request) -> list[int] | None:
    """What the renderer answers once its build (started by the first ask) has ended."""
    first = await tokens.token_ids(request)
    for _ in range(500):
        if tokens._building is None:
            break
        await asyncio.sleep(0.01)
    return first if first is not None else await tokens.token_ids(request)


def test_the_renderer_is_built_once_in_the_background_and_retried_after_a_failure(
        monkeypatch):
    builds = []

    def build(spec):
        builds.append(spec)
        if len(builds) == 1:
            raise ImportError("no vLLM here")
        return FakeTokenizer()

    clock = [100.0]
    # The module's clock only (asyncio's own sleeps run on the real one).
    monkeypatch.setattr(engine_tokens, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    tokens = EngineTokens({"model_id": "m"}, build=build)

    async def main():
        # No request waits for the build: the first is answered None at once.
        assert await tokens.token_ids(chat()) is None
        assert await rendered(tokens, chat()) is None  # the build failed
        assert await tokens.token_ids(chat()) is None  # not tried again yet
        clock[0] += engine_tokens.RETRY_S
        assert await rendered(tokens, chat()) == RENDERED
        assert await tokens.token_ids(chat()) == RENDERED

    asyncio.run(main())
    assert len(builds) == 2


def test_a_chat_with_media_is_not_rendered_in_the_router():
    """Rendering would fetch the image in the router's process, for ids vLLM ignores."""
    image = {"type": "image_url", "image_url": {"url": "http://10.0.0.9/cat.png"}}
    text = {"type": "text", "text": "what is it?"}
    with_media = chat(messages=[{"role": "user", "content": [text, image]}])
    text_parts = chat(messages=[{"role": "user", "content": [text, text]}])

    async def main():
        renderer = FakeTokenizer()
        tokens = EngineTokens({}, build=lambda spec: renderer)
        await rendered(tokens, chat())
        assert await tokens.token_ids(with_media) is None
        assert await tokens.token_ids(text_parts) == RENDERED
        return renderer.payloads

    payloads = asyncio.run(main())
    assert [p["messages"][0]["content"] for p in payloads][-1] == [text, text]
    assert not any(image in (p["messages"][0]["content"] or []) for p in payloads
                   if isinstance(p["messages"][0]["content"], list))


def test_a_request_the_engine_will_refuse_renders_to_nothing():
    async def main():
        tokens = EngineTokens({}, build=lambda spec: FakeTokenizer(error=ValueError("role")))
        assert await rendered(tokens, chat()) is None
        tokens = EngineTokens({}, build=lambda spec: FakeTokenizer(ids=[]))
        assert await rendered(tokens, chat()) is None

    asyncio.run(main())


def prompt_keys(engine=None, forward_ids=True):
    keys = PromptKeys("/unused", ModelSpec(**SPEC), "default", PAGE, secret=SECRET,
                      engine=engine, forward_ids=forward_ids)
    keys.token_ids = lambda request: [9] * (2 * PAGE)  # the tokenizer's own template
    return keys


@pytest.mark.parametrize("request_, forward_ids, expected", [
    (chat(), True, (RENDERED, True)),
    (chat(), False, (RENDERED, False)),  # the user turned handing over off
    (completion(), True, (RENDERED, True)),
    (completion(echo=True), True, (RENDERED, False)),
    (chat(kv_transfer_params={FORWARD_KEY: [4, 4]}), True, ([4, 4], False)),  # the client's
    (completion(prompt=[4, 4]), True, ([4, 4], False)),
])
def test_the_ids_are_the_client_s_else_the_engine_s_rendering(request_, forward_ids,
                                                               expected):
    async def main():
        engine = EngineTokens({}, build=lambda spec: FakeTokenizer())
        await rendered(engine, chat())
        return await prompt_keys(engine, forward_ids).request_ids(request_)

    got = asyncio.run(main())
    assert (got.token_ids, got.forward) == expected


def test_without_the_engine_s_renderer_the_tokenizer_keys_and_nothing_is_handed_over():
    async def main(engine):
        if engine is not None:
            await rendered(engine, chat())
        return await prompt_keys(engine).request_ids(chat())

    for engine in (None, EngineTokens({}, build=lambda spec: FakeTokenizer(ids=None))):
        got = asyncio.run(main(engine))
        assert (got.token_ids, got.forward) == ([9] * (2 * PAGE), False)


def test_the_router_keys_the_engine_s_ids_and_hands_them_to_the_engine():
    async def main():
        router, replicas = make_router(AsyncFakeDirectory(), Follower())
        router._prompt_keys.engine = EngineTokens({}, build=lambda spec: FakeTokenizer())
        await rendered(router._prompt_keys.engine, chat())
        router._prompt_keys.secret = SECRET
        request = chat()
        pending = PendingRequest(args=[request], kwargs={},
                                 metadata=RequestMetadata(request_id="q",
                                                          internal_request_id="q"))
        assert await router._keys_of(pending) == b"".join(CHAIN.keys(RENDERED))
        assert request.kv_transfer_params == {FORWARD_KEY: RENDERED}
        ranks = await router.choose_replicas(replicas, pending)  # and it routes as before
        assert len(ids(ranks)) >= 1
        assert request.kv_transfer_params[FORWARD_KEY] == RENDERED

    asyncio.run(main())
