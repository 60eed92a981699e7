"""The vllm-serve phase tool's hooks (vllm_serve_phases/site/sitecustomize.py) wrap raykv's
methods; a wrapper that takes fewer arguments than the method it replaces breaks every call
in a phase run. Loaded without RAYKV_PHASES_DIR, the hooks install nothing and log nothing."""

from __future__ import annotations

import importlib.util
import inspect
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.serving import vllm_io, vllm_service
from cluster.serving.step_budget import StepBudget
from cluster.tools.bench import vllm_serve_phases

SITE = Path(vllm_serve_phases.__file__).parent / "site" / "sitecustomize.py"


def load_hooks(monkeypatch, saves: str = "now"):
    """The hooks module, loaded fresh with no phases dir (they log nothing) and `saves` as
    run.py's --saves."""
    monkeypatch.delenv("RAYKV_PHASES_DIR", raising=False)
    monkeypatch.delenv("RAYKV_PHASES_COMPAT", raising=False)
    monkeypatch.setenv("RAYKV_PHASES_SAVES", saves)
    spec = importlib.util.spec_from_file_location("raykv_phase_hooks", SITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def hooks(monkeypatch):
    return load_hooks(monkeypatch)


def wrapped(original: type, patch) -> type:
    """A subclass of `original` with `patch` applied to it (the original class is untouched)."""
    copy = type(original.__name__, (original,), {})
    patch(SimpleNamespace(**{original.__name__: copy}))
    return copy


def test_the_lookup_hook_passes_on_what_the_connector_gives_poll(hooks):
    calls = []

    class Lookups:  # poll with the real one's parameters, recording what reaches it
        def poll(self, request_id, tokens, salt_of, budget=None):
            calls.append((request_id, tokens, budget))

        def _lookup(self, tokens, salt_of):
            return None

    assert list(inspect.signature(Lookups.poll).parameters) \
        == list(inspect.signature(vllm_service.Lookups.poll).parameters)
    hooks._patch_service(SimpleNamespace(Lookups=Lookups))
    budget = StepBudget()
    holder = SimpleNamespace(_pending={})
    Lookups.poll(holder, "r", [1, 2], lambda: None, budget)  # as the connector calls it
    Lookups.poll(holder, "s", [3], lambda: None)
    assert calls == [("r", [1, 2], budget), ("s", [3], None)]


def test_every_io_hook_binds_the_arguments_of_the_method_it_replaces(hooks):
    mover = wrapped(vllm_io.KVMover, hooks._patch_io)
    for name in ("start_load", "load", "save", "_put"):
        original = inspect.signature(getattr(vllm_io.KVMover, name))
        arguments = [object() for _ in list(original.parameters)[1:]]
        inspect.signature(getattr(mover, name)).bind(object(), *arguments)


def test_the_saves_experiment_holds_each_put_back_then_puts(monkeypatch):
    """run.py --saves delay: the saver thread's put starts SAVE_DELAY_S late, and is the
    connector's own; "now" leaves the put as it is."""
    module = load_hooks(monkeypatch, "delay")
    puts = []

    def put(self, spec, kv):
        puts.append((time.perf_counter(), spec, kv))

    held = module._put_as_asked(put)
    start_s = time.perf_counter()
    held(object(), "spec", "kv")
    assert [(s, k) for _, s, k in puts] == [("spec", "kv")]
    assert puts[0][0] - start_s >= module.SAVE_DELAY_S
    assert load_hooks(monkeypatch)._put_as_asked(put) is put
