"""Hypothesis over raykv's two front doors, against the running service (no fakes):

    run_client_fuzz   KVClient.put/get/lookup/prefetch with every kind of token list, KV
                      tensor and out buffer (shapes, dtypes, token types, sizes), connect()
                      with odd namespaces, ModelSpec with odd geometry
    run_http_fuzz     the OpenAI endpoints with malformed JSON, wrong types, unknown models,
                      huge prompts, odd methods, paths and keys

A bad input must be refused with a clear error (TypeError/ValueError from the client; a 4xx
with OpenAI's error JSON over HTTP); a good one must work, and every page a get returns must
hold exactly the bytes put for that prefix. Anything else (another exception, a 5xx other than
503's overload, a hang, a body that is not the documented shape, a service that stops
answering) fails the run with the shrunk example. Each returns the number of cases it ran.

The tests run these (tests/actors/test_fuzz_service.py, tests/cluster/test_serving.py) and so
does `raykv bench faults` (its "fuzz_cases"). Needs hypothesis (the dev extra).
"""

from __future__ import annotations

import json

import numpy as np
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from cluster.core.spec import ModelSpec

# ---- the client API ---------------------------------------------------------------------

REFUSED = (TypeError, ValueError)
MAX_FUZZ_PAGES = 5


def expected_kv(spec: ModelSpec, tokens: list[int]) -> torch.Tensor:
    """The KV a fuzz case puts for `tokens`: each token's values depend only on its prefix, so
    any page of any put of the same prefix holds the same bytes (a get can be checked against
    this whatever earlier case stored the page)."""
    prefix = np.zeros(len(tokens), np.int64)
    rolling = 0
    for index, token in enumerate(tokens):
        rolling = (rolling * 1_000_003 + int(token) + 1) % (1 << 61)
        prefix[index] = rolling % 997
    layers = np.arange(spec.num_layers)[:, None, None, None, None] * 11
    halves = np.arange(2)[None, :, None, None, None] * 5
    heads = np.arange(spec.num_kv_heads)[None, None, :, None, None] * 3
    dims = np.arange(spec.head_dim)[None, None, None, None, :] * 7
    values = (prefix[None, None, None, :, None] + layers + halves + heads + dims) % 1000 / 8.0
    return torch.from_numpy(values.astype(np.float32)).to(spec.torch_dtype())


def _token_lists(page_tokens: int, vocab: int) -> st.SearchStrategy:
    # Whole pages from a few fixed blocks, then a tail: cases share prefixes (and hit what
    # earlier ones put), whatever the page size.
    blocks = [list(range(b * page_tokens, (b + 1) * page_tokens)) for b in range(vocab)]
    good = st.tuples(st.lists(st.sampled_from(blocks), max_size=MAX_FUZZ_PAGES),
                     st.lists(st.integers(0, 2**32 - 1), max_size=page_tokens)).map(
        lambda parts: [t for block in parts[0] for t in block] + parts[1])
    wide = st.lists(st.integers(0, 2**32 - 1), max_size=40)
    arrays = st.one_of(
        good.map(lambda xs: np.array(xs, dtype=np.int64)),
        good.map(lambda xs: torch.tensor(xs, dtype=torch.int64)),
        st.sampled_from([np.zeros((2, 2), np.int64), np.array([1.5, 2.5]),
                         np.array([True, False]), np.array(["a"]), np.zeros(3, np.uint8),
                         torch.zeros(2, 3, dtype=torch.int32), torch.tensor([0.5])]))
    others = st.sampled_from(["text", 42, None, {1: 2}, b"bytes", 3.5, range(5), (1, 2)])
    return st.one_of(good, good, wide, bad_token_lists(), arrays, others)


def bad_token_lists() -> st.SearchStrategy:
    """Token lists with at least one item that is no uint32 token (a float, text, a bool,
    None, a negative or too large int, a nested list), after a good first token."""
    items = st.one_of(st.floats(), st.text(max_size=3), st.booleans(), st.none(),
                      st.integers(max_value=-1), st.integers(min_value=2**32),
                      st.lists(st.integers(0, 9), max_size=2))
    return st.lists(items, min_size=1, max_size=5).map(lambda xs: [0, *xs])


def _plain(tokens: object) -> list[int] | None:
    """`tokens` as a list of ints when it is a good token list, else None."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer) or \
                tokens.dtype == np.bool_:
            return None
        tokens = tokens.tolist()
    if isinstance(tokens, (list, tuple, range)) and all(
            type(t) is int and 0 <= t < 2**32 for t in tokens):
        return list(tokens)
    return None


def _kv_cases(spec: ModelSpec) -> st.SearchStrategy:
    """("good", None) for the prefix's own KV, or a wrong one: shape, dtype or type."""
    dtypes = st.sampled_from([torch.float16, torch.float32, torch.bfloat16, torch.int8,
                              torch.float64, torch.uint8])
    shapes = st.lists(st.integers(0, 9), min_size=0, max_size=6)
    wrong = st.one_of(
        st.tuples(shapes, dtypes).map(lambda sd: torch.zeros(sd[0], dtype=sd[1])),
        st.sampled_from([None, [[0.0]], np.zeros((2, 2, 2, 4, 8)), "kv", 7]))
    return st.one_of(st.just(("good", None)), st.just(("good", None)), st.tuples(
        st.just("wrong"), wrong))


def _check_get(spec: ModelSpec, tokens: list[int] | None, result: tuple) -> None:
    hit_tokens, kv = result
    if tokens is None or hit_tokens == 0:
        assert kv is None or hit_tokens == 0
        return
    assert 0 < hit_tokens <= len(tokens), f"{hit_tokens} hit tokens of {len(tokens)}"
    want = expected_kv(spec, tokens[:hit_tokens])
    got = kv[..., :hit_tokens, :]
    assert got.shape == want.shape and torch.equal(got.cpu(), want), \
        f"wrong bytes for a {hit_tokens}-token prefix"


def _client_case(client, op: str, tokens: object, kv_case: tuple, out_kind: str) -> None:
    spec = client.spec
    plain = _plain(tokens)
    try:
        if op == "put":
            kind, kv = kv_case
            if kind == "good":  # the prefix's own KV (a 4-token one beside bad tokens)
                kv = expected_kv(spec, plain if plain is not None else [0, 1, 2, 3])
            stored = client.put(tokens, kv)
            assert isinstance(stored, int) and 0 <= stored and stored % client.page_tokens == 0
        elif op == "get":
            out = None
            if out_kind == "fits" and plain is not None:
                out = torch.empty_like(expected_kv(spec, plain))
            elif out_kind == "wrong":
                out = torch.zeros(3, 2, dtype=torch.float32)
            _check_get(spec, plain, client.get(tokens, out))
        elif op == "lookup":
            found = client.lookup(tokens)
            assert isinstance(found, int) and 0 <= found
        else:
            assert client.prefetch(tokens) >= 0
    except REFUSED:
        pass  # a clear refusal of bad input


def run_client_fuzz(client, max_examples: int, random_seed: int = 0,
                    vocab: int = 3) -> int:
    """Fuzz `client` (a KVClient on the running service) with `max_examples` cases; returns
    how many ran. Raises AssertionError (with Hypothesis's shrunk example) on a wrong byte or
    an error that is not a clear refusal."""
    ran = [0]

    @seed(random_seed)
    @settings(max_examples=max_examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(op=st.sampled_from(["put", "put", "get", "get", "lookup", "prefetch"]),
           tokens=_token_lists(client.page_tokens, vocab), kv_case=_kv_cases(client.spec),
           out_kind=st.sampled_from(["none", "fits", "wrong"]))
    def case(op, tokens, kv_case, out_kind):
        ran[0] += 1
        _client_case(client, op, tokens, kv_case, out_kind)

    case()
    return ran[0]


def run_api_fuzz(max_examples: int, random_seed: int = 0) -> int:
    """Fuzz connect()'s namespaces and ModelSpec's geometry (on the running service): a clear
    TypeError/ValueError or a working client. Returns how many cases ran."""
    from cluster.api import connect

    ran = [0]
    names = st.one_of(st.text(max_size=12), st.sampled_from(["default", "", " ", "../x",
                                                             "a" * 300, "\x00", "ns/..\\"]),
                      st.integers(), st.none())
    dims = st.one_of(st.integers(-2, 8), st.sampled_from([True, 2.5, "4", None]))
    dtypes = st.sampled_from(["float16", "bfloat16", "float32", "fp8", "int4", "", 3])

    @seed(random_seed)
    @settings(max_examples=max_examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(namespace=names, layers=dims, heads=dims, head_dim=dims, dtype=dtypes)
    def case(namespace, layers, heads, head_dim, dtype):
        ran[0] += 1
        try:  # a name per geometry: one name registered with two is refused at connect
            spec = ModelSpec(f"fuzz-{layers}x{heads}x{head_dim}-{dtype}", layers, heads,
                             head_dim, dtype)
        except REFUSED:
            spec = ModelSpec("fuzz-spec", 1, 1, 8, "float16")
        try:
            client = connect(spec, namespace)
        except REFUSED:
            return
        assert client.namespace == namespace and client.lookup([1, 2, 3]) >= 0

    case()
    return ran[0]


# ---- the HTTP API -------------------------------------------------------------------------

ALLOWED_STATUSES = {200, 400, 401, 403, 404, 405, 413, 429, 503}
HTTP_TIMEOUT_S = 60.0


def _json_values() -> st.SearchStrategy:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                        st.text(max_size=20))
    return st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=12)


def _request_bodies(model: str) -> st.SearchStrategy:
    text = st.text(max_size=60)
    models = st.one_of(st.just(model), st.just(model), st.text(max_size=10), st.integers(),
                       st.none())
    max_tokens = st.one_of(st.integers(1, 3), st.integers(1, 3), st.integers(-5, 0),
                           st.integers(5000, 10**12), st.sampled_from(["4", 2.5, None, True]))
    prompts = st.one_of(text, text.map(lambda t: [t]), st.lists(text, min_size=2, max_size=3),
                        st.integers(), st.none(), st.lists(st.integers(0, 9), max_size=4),
                        st.integers(1, 40).map(lambda k: "long prompt " * (k * 100)))
    roles = st.sampled_from(["user", "system", "assistant", "robot", "", 5])
    contents = st.one_of(text, st.none(), st.integers(),
                         st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "x"]),
                                                         "text": text}), max_size=3))
    messages = st.one_of(
        st.lists(st.fixed_dictionaries({"role": roles, "content": contents}), max_size=4),
        st.text(max_size=5), st.none(), st.lists(st.integers(), max_size=2))
    common = {"model": models, "max_tokens": max_tokens,
              "temperature": st.one_of(st.floats(0, 2), st.floats(-3, 5), st.just("hot")),
              "stream": st.one_of(st.booleans(), st.just("yes")),
              "stop": st.one_of(st.none(), text, st.lists(text, max_size=6), st.integers()),
              "seed": st.one_of(st.none(), st.integers(), st.text(max_size=3))}
    optional = {"prompt": prompts, "messages": messages, "n": st.integers(0, 3),
                "top_p": st.floats(-1, 2), "user": st.one_of(text, st.integers()),
                "junk": _json_values()}
    return st.fixed_dictionaries(common, optional=optional)


def _http_cases(model: str) -> st.SearchStrategy:
    routes = st.sampled_from([("POST", "/v1/completions"), ("POST", "/v1/completions"),
                              ("POST", "/v1/chat/completions"),
                              ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                              ("POST", "/v1/models"), ("GET", "/v1/completions"),
                              ("PUT", "/v1/chat/completions"), ("POST", "/v1/nothing"),
                              ("GET", "/../etc/passwd")])
    raw = st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode),
                    _request_bodies(model).map(lambda b: json.dumps(b)[:-1].encode()),
                    _json_values().map(lambda v: json.dumps(v).encode()),
                    st.integers(1, 3).map(lambda k: b"x" * (k << 20)))  # past the size limit
    bodies = st.one_of(_request_bodies(model).map(lambda b: json.dumps(b).encode()),
                       _request_bodies(model).map(lambda b: json.dumps(b).encode()), raw)
    auth = st.sampled_from(["key", "key", "key", "none", "wrong"])
    namespaces = st.one_of(st.none(), st.none(), st.just("default"), st.text(
        alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=8))
    return st.tuples(routes, bodies, auth, namespaces)


def _headers(api_key: str | None, auth: str, namespace: str | None) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    if api_key is not None and auth != "none":
        headers["authorization"] = f"Bearer {api_key if auth == 'key' else api_key + 'x'}"
    if namespace is not None:
        headers["x-raykv-namespace"] = namespace
    return headers


def _check_reply(reply) -> None:
    status = reply.status_code
    assert status in ALLOWED_STATUSES, f"status {status}: {reply.text[:300]}"
    if status != 200:
        assert "error" in reply.json(), reply.text[:300]
        return
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in reply.text.splitlines() if line.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", reply.text[-300:]
        for line in lines[:-1]:
            assert "choices" in json.loads(line[6:]) or "error" in json.loads(line[6:])
        return
    body = reply.json()
    assert "data" in body or "choices" in body, reply.text[:300]


def run_http_fuzz(base_url: str, api_key: str | None, max_examples: int,
                  random_seed: int = 0) -> int:
    """Fuzz the OpenAI endpoints at `base_url` (e.g. http://127.0.0.1:8000) with
    `max_examples` requests; returns how many ran. Each reply must be a documented status
    with OpenAI's error JSON (never a 500 or a hang), and the service must still serve a good
    request at the end."""
    import httpx

    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url, timeout=HTTP_TIMEOUT_S) as http:
        model = http.get("/v1/models", headers=auth).json()["data"][0]["id"]
        ran = [0]

        @seed(random_seed)
        @settings(max_examples=max_examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=_http_cases(model))
        def case(case):
            (method, path), body, auth_kind, namespace = case
            ran[0] += 1
            reply = http.request(method, path, content=body,
                                 headers=_headers(api_key, auth_kind, namespace))
            _check_reply(reply)

        case()
        good = http.post("/v1/completions", headers=auth, json={
            "model": model, "prompt": "still serving?", "max_tokens": 2})
        assert good.status_code == 200, f"after the fuzz: {good.status_code} {good.text[:300]}"
    return ran[0]
