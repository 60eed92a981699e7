"""The operator API on a local Ray: a pinned prefix survives memory pressure that evicts an
unpinned one, and is evicted once its TTL ends or it is unpinned; a pin past the node's cap
is refused whole; a high-priority namespace keeps its pages when a low one gives; the CLI's
pin, unpin, warm and quota --priority. (Warming onto another node: tests/cluster.)"""

from __future__ import annotations

import json
import time

import pytest
import ray
from typer.testing import CliRunner

from cluster import ModelSpec, Quota, add_namespace, connect
from cluster.serving import tokenizer
from cluster.tools.cli import app
from tests.kv import kv_for
from tests.waiting import wait_until

TINY = ModelSpec.preset("tiny-llama")
PAGE = 8192  # tiny-llama, 16 tokens, float32
# No device tier, no disk: memory pressure drops pages from the host tier's 8, least
# recently used first (recfreq would keep a page read often, pinned or not).
PRESSED = dict(device_bytes=0, host_bytes=8 * PAGE, disk_bytes=0, rebalance=False,
               eviction="lru")


def prompt(index: int) -> list[int]:
    return [index * 100 + i for i in range(32)]  # two pages


def store(client, index: int) -> None:
    assert client.put(prompt(index), kv_for(TINY, 32, index)) == 32
    keys = client.keys(prompt(index))
    wait_until(lambda: len(client.locate_keys(keys)) == 2, 10, "the directory to hear")


def press(client, first: int, num_prompts: int) -> None:
    """Put prompts that need the whole host tier."""
    for index in range(first, first + num_prompts):
        client.put(prompt(index), kv_for(TINY, 32, index))


def gone(client, index: int) -> bool:
    return client.lookup(prompt(index)) == 0


def pinned_pages(client) -> int:
    return client.stats()["node"]["pins"]["pinned_pages"]


def test_a_pinned_prefix_survives_pressure_that_evicts_an_unpinned_one(service):
    service(**PRESSED)
    client = connect(TINY)
    store(client, 0)
    store(client, 1)
    assert client.pin(prompt(0), ttl_s=60) == 2
    press(client, 10, 4)  # eight new pages into eight slots
    wait_until(lambda: gone(client, 1), 10, "the unpinned prompt to be evicted")
    assert client.lookup(prompt(0)) == 32
    num_tokens, kv = client.get(prompt(0))
    assert num_tokens == 32 and kv.equal(kv_for(TINY, 32, 0))
    assert client.unpin(prompt(0)) == 2 and pinned_pages(client) == 0
    press(client, 20, 4)
    wait_until(lambda: gone(client, 0), 10, "the unpinned prompt to be evicted")


def test_a_pin_ends_at_its_ttl(service):
    service(**PRESSED)
    client = connect(TINY)
    store(client, 0)
    assert client.pin(prompt(0), ttl_s=1.0) == 2
    press(client, 10, 4)
    assert client.lookup(prompt(0)) == 32  # still pinned
    time.sleep(1.2)
    assert pinned_pages(client) == 0  # expired, with no call to end it
    press(client, 20, 4)
    wait_until(lambda: gone(client, 0), 10, "the expired pin's pages to be evicted")
    assert client.stats()["node"]["pins"]["expired_pins"] == 1


def test_a_pin_past_the_cap_is_refused_and_pins_nothing(service):
    service(**PRESSED, max_pinned_fraction=0.25)  # two of the eight pages
    client = connect(TINY)
    store(client, 0)
    store(client, 1)
    long_prompt = prompt(0)[:16] + [7] * 16  # shares page 0 with prompt 0
    assert client.pin(prompt(0), ttl_s=60) == 2
    with pytest.raises(ValueError, match="past its cap"):
        client.pin(prompt(1), ttl_s=60)
    assert pinned_pages(client) == 2
    assert client.pin(long_prompt, ttl_s=60) == 1  # only page 0 is stored, pinned already
    with pytest.raises(ValueError, match="ttl_s"):
        client.pin(prompt(0), ttl_s=0)
    assert client.unpin(prompt(1)) == 0  # never pinned
    assert client.unpin(prompt(0)) == 2 and client.unpin(long_prompt) == 1


def test_a_high_priority_namespace_keeps_its_pages_when_a_low_one_gives(service):
    service(**PRESSED)
    add_namespace("gold", Quota(priority="high"))
    add_namespace("bronze", Quota(priority="low"))
    gold, bronze = connect(TINY, "gold"), connect(TINY, "bronze")
    for index in range(2):  # gold's pages are the oldest: alone, LRU would take them first
        store(gold, index)
    for index in range(2, 4):
        store(bronze, index)
    press(gold, 10, 2)  # four more pages: whoever asks, bronze gives
    wait_until(lambda: gone(bronze, 2) and gone(bronze, 3), 10, "bronze to give its pages")
    assert all(gold.lookup(prompt(index)) == 32 for index in range(2))
    assert connect(TINY).stats()["node"]["memory"]["quotas"]["namespaces"]["gold"][
        "priority"] == "high"


def test_the_operator_cli(service, tmp_path):
    service(**{**PRESSED, "host_bytes": 32 * PAGE})  # pins may hold 16 pages
    client = connect(TINY)
    text = "a system prompt that every tenant's users share " * 2
    tokens = tokenizer.encode(text)
    client.put(tokens, kv_for(TINY, len(tokens)))
    wait_until(lambda: len(client.locate_keys(client.keys(tokens))) == len(tokens) // 16, 10,
               "the directory to hear")
    runner = CliRunner()
    base = ["--model", "tiny-llama"]
    pinned = runner.invoke(app, ["pin", "--text", text, "--ttl", "30", *base])
    assert pinned.exit_code == 0, pinned.output
    assert f"pinned {len(tokens) // 16} of the prompt's {len(tokens) // 16} pages" in \
        pinned.output
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(tokens))
    unpinned = runner.invoke(app, ["unpin", "--tokens-file", str(path), *base])
    assert unpinned.exit_code == 0 and f"unpinned {len(tokens) // 16} pages" in unpinned.output
    here = ray.get_runtime_context().get_node_id()
    warmed = runner.invoke(app, ["warm", "--node", here[:8], "--text", text, *base])
    assert warmed.exit_code == 0, warmed.output
    assert f"{len(tokens) // 16} of the prompt's" in warmed.output
    unknown = runner.invoke(app, ["warm", "--node", "feedbeef", "--text", text, *base])
    assert unknown.exit_code == 2 and "is not a raykv node" in words(unknown.output)
    quota = runner.invoke(app, ["quota", "namespace", "vip", "--priority", "high"])
    assert quota.exit_code == 0 and "high" in quota.output, quota.output


def words(output: str) -> str:
    """The CLI's output as one line of words (rich boxes and wraps long errors)."""
    return " ".join(output.replace("│", " ").split())
