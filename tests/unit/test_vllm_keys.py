"""What keys a vLLM request's pages (its LoRA adapter, cache_salt, multimodal inputs, the
worker's TP rank and PP stage, the cache dtype), and the scheduler's lookups off its thread:
None while in flight, then the answer, and a miss past the timeout. No vLLM: requests and
configs are read by attribute."""

import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from cluster.core.spec import ModelSpec
from cluster.serving.vllm_keys import adapter_identity, request_salt
from cluster.serving.vllm_service import (
    MISS,
    Answer,
    Lookups,
    UnsupportedConfig,
    spec_of,
)


def write_adapter(path, scale: float):
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules":
                                                          ["q_proj", "v_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(torch.full((64,), scale).numpy().tobytes())
    return str(path)


def request(**fields):
    lora = fields.pop("lora", None)
    return SimpleNamespace(prompt_embeds=fields.pop("prompt_embeds", None),
                           lora_request=lora and SimpleNamespace(lora_name=lora[0],
                                                                 lora_path=lora[1]),
                           cache_salt=fields.pop("cache_salt", None),
                           mm_features=fields.pop("mm_features", []))


def test_a_plain_request_keys_as_raykvs_own_engine():
    assert request_salt(request()) == b""


def test_two_adapters_key_apart_and_one_adapter_under_two_names_keys_alike(tmp_path):
    a = write_adapter(tmp_path / "a", 0.1)
    b = write_adapter(tmp_path / "b", 0.2)  # same config, other weights
    a_copy = write_adapter(tmp_path / "a-copy", 0.1)
    salts = {name: request_salt(request(lora=(name, path)))
             for name, path in (("a", a), ("b", b), ("other-name", a_copy))}
    assert salts["a"] != salts["b"] and salts["a"] == salts["other-name"] != b""
    # Not a local directory (vLLM resolves it elsewhere): its name and path.
    assert adapter_identity("org/adapter", "x") != adapter_identity("org/adapter", "y")


def test_an_adapter_rewritten_in_place_is_hashed_again(tmp_path):
    path = write_adapter(tmp_path / "a", 0.1)
    before = adapter_identity(path, "a")
    time.sleep(0.01)
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(
        torch.full((64,), 0.3).numpy().tobytes())
    assert adapter_identity(path, "a") != before


def test_cache_salt_and_multimodal_inputs_set_keys_apart():
    image = SimpleNamespace(modality="image", mm_hash="h1", identifier="h1",
                            mm_position=SimpleNamespace(offset=3, length=10))
    other = SimpleNamespace(modality="image", mm_hash="h2", identifier="h2",
                            mm_position=SimpleNamespace(offset=3, length=10))
    salts = [request_salt(r) for r in (request(), request(cache_salt="s1"),
                                       request(cache_salt="s2"), request(mm_features=[image]),
                                       request(mm_features=[other]),
                                       request(cache_salt="s1", mm_features=[image]))]
    assert len(set(salts)) == len(salts)
    assert request_salt(request(cache_salt="s1")) == salts[1]


def test_prompt_embeddings_are_not_keyed():
    assert request_salt(request(prompt_embeds=torch.zeros(4, 8))) is None


def vllm_config(cache_dtype="auto", tp=1, pp=1, rank=0, layers=4, mla_latent=None):
    model = SimpleNamespace(dtype=torch.bfloat16, served_model_name="m",
                            get_num_layers=lambda parallel: layers // pp,
                            get_num_kv_heads=lambda parallel: 1 if mla_latent else 8 // tp,
                            get_head_size=lambda: mla_latent or 64,
                            use_mla=mla_latent is not None)
    return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(
        cache_dtype=cache_dtype), parallel_config=SimpleNamespace(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, rank=rank))


def test_fp8_caches_map_to_raykvs_fp8_and_others_are_refused_not_raised_through():
    assert spec_of(vllm_config("auto"), None).dtype == "bfloat16"
    assert spec_of(vllm_config("fp8"), None).dtype == "fp8"
    assert spec_of(vllm_config("fp8_e4m3"), None).dtype == "fp8"
    for unsupported in ("fp8_e5m2", "fp8_inc", "fp8_ds_mla"):
        with pytest.raises(UnsupportedConfig, match=unsupported):
            spec_of(vllm_config(unsupported), None)


def test_an_mla_latent_is_two_planes_of_half_its_size():
    """vLLM's head size for MLA is the whole latent (576 for DeepSeek-V3); the connector's
    page holds its halves as K's and V's planes. The spec used the whole latent, so every
    MLA worker turned itself off (its caches fill [L, 2, 1, N, 288], the spec said 576)."""
    spec = spec_of(vllm_config(mla_latent=576), None)
    assert (spec.num_kv_heads, spec.head_dim) == (1, 288)
    with pytest.raises(UnsupportedConfig, match="latent of 575"):
        spec_of(vllm_config(mla_latent=575), None)


def test_tp_ranks_and_pp_stages_key_apart():
    names = {spec_of(vllm_config(tp=2, pp=2, rank=rank), None).name for rank in range(4)}
    assert names == {"m|tp0of2|pp0of2", "m|tp1of2|pp0of2", "m|tp0of2|pp1of2",
                     "m|tp1of2|pp1of2"}
    assert spec_of(vllm_config(), "small").name == "small"


class SlowClient:
    page_tokens, timeout_s = 16, 0.5

    def __init__(self):
        self.gate, self.asked = threading.Event(), []

    def salted(self, extra):
        self.asked.append(extra)
        return self

    def prefetch(self, tokens):
        self.gate.wait(5)
        return len(tokens) // 16 * 16


class FakeLink:
    def __init__(self, client):
        self._client = client

    def client(self):
        return self._client

    def call_timeout_s(self):
        return self._client.timeout_s

    def prefetch(self, client, tokens):
        return client.prefetch(tokens)


def poll_until_answered(lookups, request_id, tokens, salt=b"", timeout_s=5.0):
    deadline_s = time.monotonic() + timeout_s
    while (answer := lookups.poll(request_id, tokens, lambda: salt)) is None:
        assert time.monotonic() < deadline_s
        time.sleep(0.01)
    return answer


def test_a_lookup_in_flight_answers_none_then_the_hit():
    client = SlowClient()
    lookups = Lookups(FakeLink(client))
    assert lookups.poll("r", list(range(40)), lambda: b"s") is None  # started, not back
    assert lookups.poll("r", list(range(40)), lambda: b"s") is None  # asked again: in flight
    client.gate.set()
    assert poll_until_answered(lookups, "r", list(range(40))) == Answer(b"s", 32, 16)
    assert client.asked == [b"s"]  # one lookup, under the request's salt
    lookups.close()


def test_a_lookup_past_the_call_timeout_is_a_miss():
    client = SlowClient()  # never answers within its 0.5 s
    lookups = Lookups(FakeLink(client))
    start_s = time.monotonic()
    assert poll_until_answered(lookups, "r", list(range(40))) == MISS
    assert 0.4 < time.monotonic() - start_s < 3.0
    client.gate.set()
    lookups.close()


def test_no_service_is_an_answer_without_hits():
    lookups = Lookups(FakeLink(None))
    lookups._link.call_timeout_s = lambda: 1.0
    assert poll_until_answered(lookups, "r", list(range(40))) == Answer(b"", 0, None)
    lookups.close()


def fake_driver(monkeypatch, initialized: bool):
    """Ray as a process sees it: joined already or not, and a driver's error listener."""
    import ray
    import ray._private.worker as ray_worker

    from cluster import api
    from cluster.serving import vllm_service

    worker = ray_worker.global_worker  # its other fields stay: Ray's log filters read them
    monkeypatch.setattr(worker, "listener_thread", object(), raising=False)
    monkeypatch.setattr(worker, "threads_stopped", threading.Event())
    monkeypatch.setattr(ray, "is_initialized", lambda: initialized)
    # Ray's log filters (installed by earlier tests' imports) read a live worker when Ray
    # says it is initialized: this fake one is not, so the link's log lines stay unhandled.
    monkeypatch.setattr(vllm_service.log, "disabled", True)
    monkeypatch.setattr(api, "join_ray", lambda address=None: None)
    monkeypatch.setattr("cluster.connect", lambda spec, namespace: SimpleNamespace(
        page_tokens=16))
    link = vllm_service.ServiceLink(vllm_service.RaykvSettings(), ModelSpec("m", 2, 2, 8,
                                                                            "float32"))
    return link, worker


def test_an_engine_that_joins_ray_for_raykv_stops_rays_error_listener(monkeypatch):
    link, worker = fake_driver(monkeypatch, initialized=False)
    assert link.client().page_tokens == 16
    assert worker.threads_stopped.is_set()  # the listener's loop exits at its next turn


def test_a_process_that_had_joined_ray_keeps_its_error_listener(monkeypatch):
    link, worker = fake_driver(monkeypatch, initialized=True)  # e.g. a user's own driver
    assert link.client().page_tokens == 16
    assert not worker.threads_stopped.is_set()


def test_an_epoch_after_a_cache_reset_sets_every_key_apart():
    """RaykvConnector.reset_cache: a fresh epoch in the salt of every request, plain or not."""
    old = [request_salt(request()), request_salt(request(cache_salt="s1"))]
    new = [request_salt(request(), b"e1"), request_salt(request(cache_salt="s1"), b"e1")]
    again = [request_salt(request(), b"e2"), request_salt(request(cache_salt="s1"), b"e2")]
    assert len(set(old + new + again)) == 6
    assert request_salt(request(), b"") == b""  # no reset: the model's own chain
