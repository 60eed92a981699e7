"""RaykvConnector's scheduler side in P/D, with vLLM's classes but no engine and no Ray: a
prefill is looked up even when vLLM's cache holds its prompt, and hands its pages over in
request_finished; a decode answers None (vLLM asks again) until raykv holds the prefill's
pages, for at most pd_wait_s."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this "
                                   "tier in .venv-vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from cluster.serving import vllm_service  # noqa: E402
from cluster.serving.vllm_connector import RaykvConnector  # noqa: E402
from cluster.serving.vllm_plan import NewRequest  # noqa: E402
from tests.vllm.test_connector_scheduler import PAGE, groups, request, vllm_config  # noqa: E402

PRODUCER = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None}


def handoff(num_tokens: int, model: str = "m") -> dict:
    return {"raykv_pd": {"tokens": num_tokens, "model": model, "namespace": "default"}}


class HoldingClient:
    """A connected raykv client holding the first `held` tokens of any prompt."""

    page_tokens, timeout_s = PAGE, 5.0

    def __init__(self):
        self.held, self.num_lookups = 0, 0

    def salted(self, extra):
        return self

    def prefetch(self, tokens):
        self.num_lookups += 1
        return min(self.held, len(tokens) // PAGE * PAGE)


@pytest.fixture
def client(monkeypatch):
    client = HoldingClient()
    monkeypatch.setattr(vllm_service.ServiceLink, "_connect", lambda self: client)
    return client


def scheduler(pd_wait_s: float = 5.0) -> RaykvConnector:
    config = vllm_config()
    config.kv_transfer_config.kv_connector_extra_config["raykv.pd_wait_s"] = pd_wait_s
    return RaykvConnector(config, KVConnectorRole.SCHEDULER, groups(FullAttentionSpec))


def ask(connector, req, num_computed_tokens=0, until=lambda answer: answer[0] is not None,
        timeout_s=5.0):
    deadline_s = time.monotonic() + timeout_s
    while not until(answer := connector.get_num_new_matched_tokens(req, num_computed_tokens)):
        assert time.monotonic() < deadline_s, answer
        time.sleep(0.01)
    return answer


def test_a_decode_asks_again_until_raykv_holds_the_prefill_s_pages(client):
    connector = scheduler()
    req = request(num_tokens=100, kv_transfer_params=handoff(96))  # 96 loadable: 6 blocks
    for _ in range(5):  # raykv's directory has not heard of the prefill's put yet
        assert connector.get_num_new_matched_tokens(req, 0) == (None, False)
        time.sleep(0.03)
    num_lookups = client.num_lookups
    assert num_lookups >= 2  # asked afresh, not answered from the first lookup
    client.held = 96
    assert ask(connector, req) == (96, True)
    assert connector.request_finished(req, []) == (False, None)  # a decode hands nothing on


def test_a_decode_takes_what_is_there_after_pd_wait_s(client):
    connector = scheduler(pd_wait_s=0.3)
    client.held = 32  # a page of three: the rest of the prefill's save was lost
    req = request(num_tokens=100, kv_transfer_params=handoff(96))
    start_s = time.monotonic()
    assert ask(connector, req) == (32, True)
    assert 0.3 <= time.monotonic() - start_s < 3.0
    # Another model's pages are never found here: no wait.
    other = request("o", num_tokens=100, kv_transfer_params=handoff(96, model="another"))
    start_s = time.monotonic()
    assert ask(connector, other) == (32, True) and time.monotonic() - start_s < 0.3


def test_a_prefill_is_looked_up_saved_and_handed_over_though_vllm_held_it(client):
    connector = scheduler()
    plain = request("q", num_tokens=100)
    assert connector.get_num_new_matched_tokens(plain, 96) == (0, False)  # no lookup
    assert client.num_lookups == 0
    prefill = request("p", num_tokens=100, kv_transfer_params=PRODUCER)
    assert ask(connector, prefill, num_computed_tokens=96) == (0, False)  # looked up
    assert client.num_lookups == 1
    planner = connector._planner
    _, saves = planner.step([NewRequest("p", list(range(100)), list(range(7)), 96, 4)], [])
    assert [(save.start, len(save.token_ids), save.keep) for save in saves] == [(0, 96, True)]
    assert connector.request_finished(prefill, []) == (False, handoff(96))
    assert connector.request_finished(plain, []) == (False, None)
