"""The serving pieces that need no Ray: tokenizer, chat template, sampling, stop strings and
the OpenAI request models."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from cluster.serving import tokenizer
from cluster.serving.protocol import ChatCompletionRequest, CompletionRequest, usage
from cluster.serving.sampling import Sampler, SamplingParams, StopText


@pytest.mark.parametrize("text", ["hello", "", "naïve – 日本語 🙂", "a\nb\tc"])
def test_any_text_round_trips(text):
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.BOS_ID and all(0 <= i < 256 for i in ids[1:])
    assert tokenizer.decode(ids) == text


def test_stream_decoder_joins_split_characters_and_replaces_bad_bytes():
    decoder = tokenizer.StreamDecoder()
    pieces = [decoder.push(b) for b in "日".encode()] + [decoder.push(tokenizer.EOS_ID)]
    assert "".join(pieces) == "日" and pieces[:2] == ["", ""]
    assert decoder.push(0xFF) + decoder.flush() == "\ufffd"


def test_chat_template_puts_each_role_under_its_header():
    text = tokenizer.apply_chat_template([tokenizer.Message("system", "be brief"),
                                          tokenizer.Message("user", "hi")])
    assert text == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"


def test_the_mask_allows_printable_text_and_eos_only():
    mask = tokenizer.text_token_mask(512)
    allowed = {i for i in range(512) if mask[i] == 0}
    assert allowed == set(range(32, 127)) | {10, tokenizer.EOS_ID}


def test_greedy_and_seeded_sampling():
    mask = tokenizer.text_token_mask(512)
    logits = torch.randn(512, generator=torch.Generator().manual_seed(1))
    greedy = Sampler(SamplingParams(), mask).next(logits)
    assert greedy == int(torch.argmax(logits + mask))
    seeded = [Sampler(SamplingParams(temperature=1.0, seed=7), mask).next(logits)
              for _ in range(3)]
    assert len(set(seeded)) == 1 and mask[seeded[0]] == 0
    draws = {Sampler(SamplingParams(temperature=5.0), mask).next(logits) for _ in range(50)}
    assert len(draws) > 1 and all(mask[d] == 0 for d in draws)


def test_top_p_keeps_only_the_nucleus():
    mask = torch.zeros(4)
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    draws = {Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=s), mask).next(logits)
             for s in range(200)}
    assert draws == {0, 1}


def test_stop_text_holds_back_a_possible_stop_and_cuts_at_it():
    stop = StopText(("END",))
    released = "".join(stop.push(piece) for piece in ["abc", "E", "N", "xy", "EN", "D", "zz"])
    assert released == "abcENxy" and stop.stopped
    assert stop.finish() == ""
    nothing = StopText(())
    assert nothing.push("abc") == "abc" and nothing.finish() == ""
    tail = StopText(("STOP",))
    assert tail.push("abcdS") == "ab" and tail.finish() == "cdS"  # 3 = len("STOP") - 1 held


def test_requests_validate_like_openai():
    ok = CompletionRequest(model="m", prompt="hi", max_tokens=4, stop="x", logprobs=None)
    assert ok.sampling(16) == SamplingParams(4, 0.0, 1.0, None, ("x",))
    assert CompletionRequest(model="m", prompt=["only"]).text() == "only"
    for bad in ({"model": "m", "prompt": ["a", "b"]}, {"model": "m", "prompt": 3},
                {"model": "m", "prompt": "x", "temperature": -1},
                {"model": "m", "prompt": "x", "n": 2}, {"prompt": "x"},
                {"model": "m", "prompt": "x", "max_tokens": 0},
                {"model": "m", "prompt": "x", "stop": ["a"] * 5}):
        with pytest.raises(ValidationError):
            CompletionRequest(**bad)
    chat = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}])
    assert chat.messages[0].text() == "a"
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[])
    # Found by a probe: each of these was a 500 (a TypeError in text(), or torch's seed
    # overflow after the prefill); now each is a request error (400).
    for text in (5, None, ["a"]):
        if text is None:
            assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
                {"type": "text", "text": text}]}]).messages[0].text() == ""
            continue
        with pytest.raises(ValidationError):
            ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
                {"type": "text", "text": text}]}])
    for part in ("a", 3, {"text": "no type"}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [part]}])
    for seed in (1 << 63, -(1 << 63) - 1, 1 << 64):
        with pytest.raises(ValidationError):
            CompletionRequest(model="m", prompt="x", seed=seed)
    assert CompletionRequest(model="m", prompt="x", seed=-1).seed == -1
    # The openai client's None is JSON null: the field's default, not a 400.
    nulls = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                  temperature=None, top_p=None, n=None, stream=None)
    assert (nulls.temperature, nulls.top_p, nulls.n, nulls.stream) == (0.0, 1.0, 1, False)
    # A prompt of token ids, or a list of one (OpenAI takes both).
    for prompt in ([1, 2, 3], [[1, 2, 3]]):
        assert CompletionRequest(model="m", prompt=prompt).token_ids() == [1, 2, 3]
    assert CompletionRequest(model="m", prompt="abc").token_ids() is None
    for bad in ([], [[]], [[1], [2]], ["a", "b"], [1.5]):
        with pytest.raises(ValidationError):
            CompletionRequest(model="m", prompt=bad)
    # What this server cannot give is refused by name, not answered without it.
    for field, value in (("logprobs", True), ("logprobs", 2), ("top_logprobs", 3),
                         ("echo", True), ("suffix", "end"), ("best_of", 2),
                         ("tools", [{"type": "function"}])):
        with pytest.raises(ValidationError, match=f"{field} is not supported"):
            CompletionRequest(model="m", prompt="x", **{field: value})
    for field, value in (("logprobs", False), ("logprobs", None), ("tools", []),
                         ("echo", False), ("best_of", 1), ("top_logprobs", 0)):
        CompletionRequest(model="m", prompt="x", **{field: value})
    assert CompletionRequest(model="m", prompt="x", seed=(1 << 63) - 1).sampling(4).seed


def test_usage_reports_cached_tokens():
    assert usage(10, 3, 8) == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                               "prompt_tokens_details": {"cached_tokens": 8}}


def test_a_mid_stream_failure_reaches_the_client_without_its_detail():
    """The stream is open, so the error goes in-band (as OpenAI does); its text, which may
    name Ray actors and internal ids, stays in the server's log."""
    import asyncio
    import json

    from cluster.serving.ingress import _sse

    async def events():
        yield {"n": 1}
        raise RuntimeError("actor 5f0c1e9a of node 10.0.0.7 died")

    released = []

    async def main():
        return [line async for line in _sse(events(), lambda: released.append(True))]

    lines = asyncio.run(main())
    assert lines[0] == 'data: {"n": 1}\n\n' and lines[-1] == "data: [DONE]\n\n"
    error = json.loads(lines[1].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    assert "10.0.0.7" not in lines[1] and "5f0c1e9a" not in lines[1]
    assert released == [True]
