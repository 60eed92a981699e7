"""The import-linter contracts in pyproject.toml cover the whole tree: every module directly
under cluster/ is named in the face layer, and every package under cluster/ is a layer."""

from __future__ import annotations

import pathlib

import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def contracts() -> list[dict]:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        return tomllib.load(handle)["tool"]["importlinter"]["contracts"]


def layer_modules() -> list[set[str]]:
    (layers,) = [c["layers"] for c in contracts() if c["type"] == "layers"]
    return [{m.strip().strip("()") for m in layer.replace("|", ":").split(":")}
            for layer in layers]


def test_every_face_module_is_in_the_face_layer():
    face = {f"cluster.{p.stem}" for p in (ROOT / "cluster").glob("*.py")
            if p.stem != "__init__"}
    layers = layer_modules()
    assert face == layers[2], f"face modules missing from the contract: {face - layers[2]}"


def test_every_package_is_a_layer():
    packages = {f"cluster.{p.parent.name}" for p in (ROOT / "cluster").glob("*/__init__.py")}
    named = set().union(*layer_modules())
    assert packages <= named, f"packages outside the layers: {packages - named}"
    assert {"actors", "policies"} <= named


def test_core_and_policies_forbid_ray():
    forbidden = [c for c in contracts() if c["type"] == "forbidden"]
    assert any(set(c["source_modules"]) >= {"cluster.core", "policies"}
               and "ray" in c["forbidden_modules"] for c in forbidden)
