"""Per-request key roots: a salted chain never meets the plain one or another salt's, a
continued chain keys the rest of a prompt as the whole chain does, and a client's salted view
stores and finds its pages apart (on the fakes of test_fetch)."""

import pytest
import torch

from cluster.core.keys import KEY_BYTES, SALT_TAG, KeyChain, page_hash
from cluster.core.spec import ModelSpec
from tests.unit._fakes import drive
from tests.unit.test_fetch import KV, PAGE_TOKENS, TOKENS, World, client_of

SPEC = ModelSpec("tiny", 2, 2, 16, "float32")
CHAIN = KeyChain.of(SPEC, "default", 4)
PROMPT = list(range(100, 118))  # 4 full pages of 4


def test_a_salt_roots_another_chain_and_no_salt_is_the_chain_itself():
    plain = CHAIN.keys(PROMPT)
    lora_a, lora_b = CHAIN.salted(b"lora-a"), CHAIN.salted(b"lora-b")
    assert CHAIN.salted(b"") is CHAIN
    assert lora_a.keys(PROMPT) == CHAIN.salted(b"lora-a").keys(PROMPT)  # deterministic
    keys = [set(plain), set(lora_a.keys(PROMPT)), set(lora_b.keys(PROMPT)),
            set(lora_a.salted(b"lora-b").keys(PROMPT))]
    assert all(not (one & other) for i, one in enumerate(keys) for other in keys[i + 1:])
    assert len(SALT_TAG) == KEY_BYTES


def test_a_salted_root_is_no_page_key_whatever_the_tokens():
    """A page key hashes a 16-byte key, then token bytes; a salted root hashes SALT_TAG first.
    Tokens spelling the salt's bytes give another key, not the salted root."""
    extra = b"abcd" * 4  # one page of 4 tokens, as bytes
    crafted = [int.from_bytes(extra[i:i + 4], "little") for i in range(0, 16, 4)]
    assert CHAIN.keys(crafted)[0] == page_hash(CHAIN.root, extra)
    assert CHAIN.keys(crafted)[0] != CHAIN.salted(extra).root
    assert CHAIN.salted(extra).root == page_hash(SALT_TAG, CHAIN.root, extra)


def test_a_continued_chain_keys_the_rest_of_the_prompt_as_the_whole_chain_does():
    keys = CHAIN.keys(PROMPT)
    for page in range(1, 4):
        assert CHAIN.continued(keys[page - 1]).keys(PROMPT[page * 4:]) == keys[page:]
    salted = CHAIN.salted(b"s")
    assert salted.continued(salted.keys(PROMPT)[0]).keys(PROMPT[4:]) == salted.keys(PROMPT)[1:]


def test_bad_salts_and_keys_are_refused():
    with pytest.raises(TypeError):
        CHAIN.salted("text")
    with pytest.raises(ValueError):
        CHAIN.continued(b"short")


def test_a_salted_client_stores_its_pages_apart(world):
    client = client_of(world)
    salted = client.salted(b"lora-a")
    kv = torch.cat([KV, KV[:, :, :, :3]], dim=3)
    assert drive(salted._put(TOKENS, kv)) == 4 * PAGE_TOKENS
    assert drive(client._lookup(TOKENS)) == 0  # the plain chain sees nothing
    assert drive(client.salted(b"lora-b")._lookup(TOKENS)) == 0
    assert drive(salted._lookup(TOKENS)) == 4 * PAGE_TOKENS
    num_tokens, out = drive(salted._get(TOKENS, None))
    assert num_tokens == 4 * PAGE_TOKENS and torch.equal(out, KV)
    assert client.salted(b"") is client and client.chain.root != salted.chain.root


def test_a_continued_put_stores_only_its_pages_under_the_whole_prompts_keys(world):
    client = client_of(world)
    assert drive(client._put(TOKENS[:2 * PAGE_TOKENS], KV[:, :, :, :2 * PAGE_TOKENS])) == 32
    rest = client.continued(client.keys(TOKENS[:2 * PAGE_TOKENS])[-1])
    assert drive(rest._put(TOKENS[2 * PAGE_TOKENS:4 * PAGE_TOKENS],
                           KV[:, :, :, 2 * PAGE_TOKENS:])) == 2 * PAGE_TOKENS
    num_tokens, out = drive(client._get(TOKENS, None))
    assert num_tokens == 4 * PAGE_TOKENS and torch.equal(out, KV)


@pytest.fixture
def world():
    world = World()
    yield world
    world.close()
