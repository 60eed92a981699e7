"""The manifests run vLLM on GPUs in bf16, start raykv alike from the head and from the Serve
apps (so the order they come up in never matters), and run Ray with token authentication."""

from __future__ import annotations

import re

import typer
import yaml

from tests.manifests._manifests import (
    MANIFESTS,
    _exec_commands,
    cluster_specs,
    has_gpu,
    invocations,
    of_kind,
    pod_groups,
    serve_files,
)

AUTH_SECRET = "raykv-ray-auth"


def _start_config(argv: list[str]):
    """The CacheConfig a `raykv start ...` command line builds."""
    from cluster.tools.cli import app
    from cluster.tools.ops_cli import start_config

    command = typer.main.get_command(app).commands["start"]
    return start_config(command.make_context("raykv start", argv[2:]).params)


def _head_starts() -> dict[str, list[str]]:
    """RayService name -> the argv of the `raykv start` its head runs (its postStart hook)."""
    starts = {}
    for _, doc in of_kind("RayService"):
        head = doc["spec"]["rayClusterConfig"]["headGroupSpec"]
        (argv,) = [argv for shell in _exec_commands(head)
                   for argv in invocations(shell, "raykv") if argv[1] == "start"]
        starts[doc["metadata"]["name"]] = argv
    return starts


def test_the_vllm_service_runs_vllm_on_gpus_in_bf16():
    from cluster.serving.vllm_app import VllmAppArgs, VllmBuildArgs

    (app,) = serve_files()["vllm-app.yaml"]["applications"]
    args = VllmBuildArgs.model_validate(app["args"])
    assert args.accelerator == "gpu"
    engine = VllmAppArgs(args.model_source, "m", accelerator=args.accelerator,
                         engine_kwargs=args.engine_kwargs)
    assert engine.dtype == "bfloat16"
    (_, service), = [(n, d) for n, d in of_kind("RayService")
                     if d["metadata"]["name"] == "raykv-vllm"]
    groups = pod_groups(service["spec"]["rayClusterConfig"])
    assert any(has_gpu(pod) for _, _, pod in groups[1:]), "no GPU worker group runs vLLM"


def test_serve_apps_start_raykv_as_the_head_does():
    from cluster import CacheConfig

    files = {"raykv-serve": "raykv-app.yaml", "raykv-vllm": "vllm-app.yaml"}
    starts = _head_starts()
    assert sorted(starts) == sorted(files)
    for name, argv in starts.items():
        (app,) = serve_files()[files[name]]["applications"]
        cache = CacheConfig(**(app["args"].get("cache") or {}))
        assert cache == _start_config(argv), f"{name}: the app would start raykv otherwise"


def test_every_kuberay_cluster_runs_ray_with_token_auth():
    for label, spec in cluster_specs():
        assert spec.get("authOptions") == {"mode": "token", "secretName": AUTH_SECRET}, label
    readme = (MANIFESTS / "README.md").read_text()
    assert f"kubectl create secret generic {AUTH_SECRET}" in readme


# The KubeRay these manifests need: authOptions.secretName first exists in v1.6.0 (v1.5.x's
# AuthOptions has only `mode`; v1.3 and v1.4 have no authOptions), and the group `resources`
# field in v1.5.1. The files' own minimum statements must all say this one.
KUBERAY_MINIMUM = "1.6.0"


def _kuberay_minimums(text: str) -> list[str]:
    """The versions a text states as KubeRay's minimum (`>= X`, `X or newer`, `X+`, with
    KubeRay named just before, not Kubernetes)."""
    text = " ".join(text.replace("*", "").split())
    found = []
    for match in re.finditer(r">=\s*v?(\d+(?:\.\d+)+)|v?(\d+(?:\.\d+)+)(?:\s+or\s+newer|\+)",
                             text):
        before = text[max(0, match.start() - 40):match.start()]
        if "KubeRay" in before and "Kubernetes" not in before.rsplit("KubeRay", 1)[1]:
            found.append(match[1] or match[2])
    return found


def test_every_stated_kuberay_minimum_is_the_one_the_manifests_need():
    """manifests/README.md and the manifests' comments state one KubeRay minimum, the version
    whose CRDs have every field the manifests use."""
    stated = {"README.md": _kuberay_minimums((MANIFESTS / "README.md").read_text())}
    for path in sorted(MANIFESTS.rglob("*")):
        if path.is_file() and path.name != "README.md" and path.suffix != ".json":
            comments = "\n".join(line.split("#", 1)[1] for line in path.read_text().splitlines()
                                 if "#" in line)
            stated[str(path.relative_to(MANIFESTS))] = _kuberay_minimums(comments)
    assert stated["README.md"], "manifests/README.md states no KubeRay minimum"
    assert stated["kuberay/raycluster.yaml"], "raycluster.yaml's header states no minimum"
    versions = {version for found in stated.values() for version in found}
    assert versions == {KUBERAY_MINIMUM}, {where: found for where, found in stated.items()
                                           if found}


def test_the_minimum_finder_reads_each_form():
    assert _kuberay_minimums("on Kubernetes (KubeRay >= 1.3, apiVersion") == ["1.3"]
    assert _kuberay_minimums("the KubeRay operator (1.3 or newer; checked against v1.7.0's")\
        == ["1.3"]
    assert _kuberay_minimums("- **KubeRay** (1.5.1 or newer): the") == ["1.5.1"]
    assert _kuberay_minimums("KubeRay 1.6.0 or newer (authOptions)") == ["1.6.0"]
    assert _kuberay_minimums("(Calico, ...); Kubernetes 1.25 or newer (endPort)") == []


def _mount_of(pod_spec: dict, path: str) -> tuple[dict, dict] | None:
    """(mount, volume) of the container mount that holds path, or None."""
    container = pod_spec["containers"][0]
    mounts = [m for m in container.get("volumeMounts", [])
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    if not mounts:
        return None
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    (volume,) = [v for v in pod_spec.get("volumes", []) if v["name"] == mount["name"]]
    return mount, volume


def test_every_group_that_may_build_or_route_the_app_mounts_its_model():
    """Serve's build task (num_cpus=0: any node, the head included) runs the app builder, and
    the ingress's router reads <model_source>/config.json and its tokenizer (vllm_app
    router_settings, prompt_keys) wherever Serve places it: every group mounts the weights at
    the path the serve config names, read-only from the one claim."""
    import ray.serve._private.application_state as application_state

    build_options = application_state.build_serve_application._default_options
    assert build_options.get("num_cpus") == 0  # schedulable on any node, the head included
    checked = 0
    for _, doc in of_kind("RayService"):
        config = yaml.safe_load(doc["spec"]["serveConfigV2"])
        paths = [app["args"]["model_source"] for app in config["applications"]
                 if str(app.get("args", {}).get("model_source", "")).startswith("/")]
        groups = pod_groups(doc["spec"]["rayClusterConfig"])
        assert groups[0][0] == "head"
        for path in paths:
            claims = set()
            for group, _, pod_spec in groups:
                found = _mount_of(pod_spec, path)
                where = f"RayService {doc['metadata']['name']} {group}"
                assert found, f"{where}: {path} is not mounted"
                mount, volume = found
                assert mount.get("readOnly") and "persistentVolumeClaim" in volume, where
                claims.add(volume["persistentVolumeClaim"]["claimName"])
                checked += 1
            assert len(claims) == 1, claims
            (claim,) = claims
            assert claim in {d["metadata"]["name"] for _, d in of_kind("PersistentVolumeClaim")}
    assert checked, "no RayService names a local model path"
