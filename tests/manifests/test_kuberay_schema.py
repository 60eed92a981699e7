"""Every KubeRay object in manifests/kuberay validates against KubeRay's CRD openAPIV3Schema
(../shared/schemas/kuberay), strictly: an unknown field is an error, as kubectl's strict field
validation makes it. x-kubernetes-* keys are annotations; int-or-string fields take either."""

from __future__ import annotations

import functools
import re

import jsonschema
import pytest
import yaml

from tests.manifests._manifests import (
    README,
    SCHEMAS,
    code_blocks,
    kubernetes_docs,
    shell_invocations,
)

CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayService": "ray.io_rayservices.yaml",
             "RayJob": "ray.io_rayjobs.yaml"}
CORE_KINDS = {"Secret": "v1", "Service": "v1", "PersistentVolumeClaim": "v1",
              "Deployment": "apps/v1", "StorageClass": "storage.k8s.io/v1",
              "NetworkPolicy": "networking.k8s.io/v1"}  # its schema: test_security.py
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf")


def strict(schema: dict) -> dict:
    """A CRD schema node as plain JSON Schema: x-kubernetes-* dropped (int-or-string becomes
    anyOf integer/string), and objects with listed properties closed to others."""
    out = {key: value for key, value in schema.items() if not key.startswith("x-kubernetes-")}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if "properties" in out:
        out["properties"] = {name: strict(sub) for name, sub in out["properties"].items()}
        if ("additionalProperties" not in out
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = strict(out["additionalProperties"])
    if isinstance(out.get("items"), dict):
        out["items"] = strict(out["items"])
    for key in _SCHEMA_LISTS:
        if key in out:
            out[key] = [strict(sub) for sub in out[key]]
    return out


@functools.cache
def crd(kind: str) -> tuple[str, dict]:
    """(apiVersion, strict schema of v1) of a KubeRay kind."""
    path = SCHEMAS / "kuberay" / CRD_FILES[kind]
    document = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = [v for v in document["spec"]["versions"] if v["name"] == "v1"]
    api_version = f"{document['spec']['group']}/v1"
    return api_version, strict(version["schema"]["openAPIV3Schema"])


@pytest.fixture(scope="module", autouse=True)
def _schemas_present():
    if not (SCHEMAS / "kuberay").is_dir():
        pytest.skip(f"KubeRay CRD schemas not found at {SCHEMAS / 'kuberay'} (the shared "
                    f"schemas folder beside the repository); KubeRay objects NOT validated")


KUBERAY_DOCS = [(name, doc) for name, doc in kubernetes_docs() if doc["kind"] in CRD_FILES]


def test_the_manifests_hold_a_raycluster_and_rayservices():
    kinds = sorted(doc["kind"] for _, doc in KUBERAY_DOCS)
    assert kinds == ["RayCluster", "RayService", "RayService"]


@pytest.mark.parametrize(("file_name", "doc"), KUBERAY_DOCS,
                         ids=[f"{n}:{d['metadata']['name']}" for n, d in KUBERAY_DOCS])
def test_kuberay_object_matches_the_crd(file_name, doc):
    api_version, schema = crd(doc["kind"])
    assert doc["apiVersion"] == api_version
    jsonschema.validate(doc, schema, cls=jsonschema.Draft7Validator)


def test_strict_validation_catches_a_misspelt_field():
    _, doc = KUBERAY_DOCS[0]
    broken = yaml.safe_load(yaml.safe_dump(doc))
    broken["spec"]["headGroupSpec"]["rayStartParam"] = {}  # not rayStartParams
    _, schema = crd(broken["kind"])
    with pytest.raises(jsonschema.ValidationError, match="rayStartParam"):
        jsonschema.validate(broken, schema, cls=jsonschema.Draft7Validator)


def test_int_or_string_fields_take_either():
    schema = strict({"type": "object", "properties": {
        "size": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"},
                                                               {"type": "string"}]},
        "port": {"x-kubernetes-int-or-string": True}}})
    for value in (8, "8Gi"):
        jsonschema.validate({"size": value, "port": value}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"port": 1.5}, schema)


def test_every_other_object_is_a_known_core_kind():
    for file_name, doc in kubernetes_docs():
        if doc["kind"] in CRD_FILES:
            continue
        assert CORE_KINDS.get(doc["kind"]) == doc["apiVersion"], (file_name, doc["kind"])
        assert doc["metadata"]["name"], file_name


def _jsonpath_exists(schema: dict, path: list[str]) -> bool:
    for name in path:
        schema = schema.get("properties", {}).get(name)
        if schema is None:
            return False
    return True


def test_the_readmes_jsonpaths_name_fields_of_the_crds():
    """A `kubectl get rayservice|raycluster ... -o jsonpath='{.a.b}'` in manifests/README.md
    reads a field the v1.7.0 CRD has (a RayService's generated cluster name among them)."""
    kinds = {"rayservice": "RayService", "raycluster": "RayCluster"}
    checked = 0
    for block in code_blocks(README.read_text()):
        for argv in shell_invocations(block, "kubectl"):
            if argv[1:2] != ["get"] or argv[2] not in kinds:
                continue
            for word in argv:
                match = re.fullmatch(r"(?:-o|--output)?=?jsonpath=\{\.([\w.]+)\}", word)
                if match:
                    _, schema = crd(kinds[argv[2]])
                    assert _jsonpath_exists(schema, match[1].split(".")), match[1]
                    checked += 1
    assert checked, "the README reads no KubeRay status field"
