"""Where the Serve app's ingress runs (AppArgs.ingress_placement): beside Serve's HTTP proxy
when that proxy runs only on the head, so that no worker node's death fails the requests the
ingress holds with Serve's own non-OpenAI HTTP 500."""

from __future__ import annotations

import pydantic
import pytest

from cluster.serving import app

HEAD = {"ray_actor_options": {"num_cpus": 0, "resources": {app.HEAD_RESOURCE: 0.001}}}


@pytest.mark.parametrize(("placement", "proxies", "options"), [
    ("auto", "HeadOnly", HEAD),
    ("auto", "EveryNode", {}),
    ("auto", None, {}),  # Serve not up (or not answering): left to Serve
    ("head", "EveryNode", HEAD),
    ("head", None, HEAD),
    ("any", "HeadOnly", {}),
])
def test_the_ingress_follows_the_proxy_or_the_operator(monkeypatch, placement, proxies,
                                                       options):
    monkeypatch.setattr(app, "serve_proxy_location", lambda: proxies)
    assert app.ingress_options(placement) == options


def test_the_placement_is_checked_and_defaults_to_auto():
    assert app.AppArgs().ingress_placement == "auto"
    with pytest.raises(pydantic.ValidationError, match="ingress_placement"):
        app.AppArgs(ingress_placement="worker")


def test_no_ray_means_no_proxy_location_to_read():
    from cluster.serving.ingress import serve_proxy_location

    assert serve_proxy_location() is None
