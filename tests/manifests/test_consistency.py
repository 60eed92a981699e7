"""The manifests ask for what the code provides: the `kv_node` resource, the HTTP and metrics
ports, the Serve apps' import paths and arguments, the `raykv` verbs and options, the env vars
the service reads, /dev/shm and disk volumes sized and placed for the tiers, one Redis wired
the same way everywhere, and one Ray version."""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import inspect
import re
import shlex
import typing
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import typer
import yaml

from cluster.core.config import CacheConfig
from cluster.core.sizing import parse_bytes
from cluster.core.spec import PRESETS
from tests.manifests._manifests import (
    DOCKERFILE,
    MANIFESTS,
    README,
    ROOT,
    all_pod_groups,
    cluster_specs,
    code_blocks,
    containers,
    env_of,
    group_specs,
    has_gpu,
    invocations,
    kubectl_selectors,
    kubernetes_docs,
    of_kind,
    pod_groups,
    ray_resources,
    ray_up,
    ray_up_commands,
    raykv_invocations,
    require,
    serve_configs,
    serve_files,
    shell_invocations,
    the,
    venv_names,
    volume_at,
)

ROUTERS = {"raykv", "pow2", "prefix"}  # the Serve app's `router` argument (issue 11 contract)
_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti|K|M|G|T)?$")
_QUANTITY_UNITS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
                   "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_bytes(text) -> int:
    """A Kubernetes quantity of bytes ("16Gi", "8589934592") as an int."""
    match = _QUANTITY.match(str(text))
    assert match, f"not a byte quantity: {text!r}"
    return int(match.group(1)) * _QUANTITY_UNITS[match.group(2)]


def http_port() -> int:
    from ray.serve._private.constants import DEFAULT_HTTP_PORT

    return DEFAULT_HTTP_PORT


# ---- the kv_node resource ---------------------------------------------------------------------


def test_every_gpu_group_offers_the_node_resource_and_the_head_does_not():
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_custom_resources

    resource = CacheConfig().node_resource
    for label, spec in cluster_specs():
        for name, group in group_specs(spec):
            offered = ray_resources(group)  # what KubeRay passes to `ray start --resources`
            # ... and what Ray's autoscaler plans with: the same
            params = group.get("rayStartParams", {})
            assert _get_custom_resources(group.get("resources", {}), params, name) == offered
            if has_gpu(group["template"]["spec"]):
                assert offered.get(resource) == 1, f"{label} {name}: no {resource!r} resource"
            else:
                assert resource not in offered, f"{label} {name}: a kv node without a GPU"


def test_no_group_passes_resources_through_ray_start_params():
    """KubeRay (v1.7.0 getResourcesMap) trims quotes, not backslashes, from
    rayStartParams.resources, so Ray's documented '"{\\"kv_node\\": 1}"' form fails to parse
    there (logged, and the group's accelerator resources are skipped); KubeRay refuses a group
    that sets both it and the group's `resources` field. The field is the one form."""
    for label, spec in cluster_specs():
        for name, group in group_specs(spec):
            params = group.get("rayStartParams", {})
            assert "resources" not in params, f"{label} {name}: rayStartParams.resources"
            if group.get("resources"):
                both = {"num-cpus", "num-gpus", "memory"} & set(params)
                assert not both, f"{label} {name}: {both} beside the resources field"


def test_ray_up_gpu_workers_offer_the_node_resource():
    resource = CacheConfig().node_resource
    types = ray_up()["available_node_types"]
    assert types["gpu_kv"]["resources"] == {resource: 1}
    assert resource not in types[ray_up()["head_node_type"]]["resources"]


# ---- ports ------------------------------------------------------------------------------------


def test_serve_configs_listen_on_serves_http_port():
    from ray.serve.schema import ServeDeploySchema

    for label, config in serve_configs():
        ServeDeploySchema.model_validate(config)  # Serve's own schema
        assert config["http_options"]["port"] == http_port() == 8000, label


def test_head_containers_expose_serve_and_metrics_ports():
    for label, group, params, pod_spec in all_pod_groups():
        ports = {p["name"]: p["containerPort"] for p in pod_spec["containers"][0]["ports"]}
        assert ports["metrics"] == int(params["metrics-export-port"]), (label, group)
        if group == "head":
            assert ports["serve"] == http_port(), label
            assert ports["gcs"] == 6379, label


def test_ray_up_nodes_export_metrics_on_one_port():
    starts = " ".join(ray_up()["head_start_ray_commands"] + ray_up()["worker_start_ray_commands"])
    assert set(re.findall(r"--metrics-export-port=(\d+)", starts)) == {"8080"}


def test_the_image_exposes_the_ports():
    exposed = re.search(r"^EXPOSE (.+)$", DOCKERFILE.read_text(), flags=re.M).group(1).split()
    assert {str(http_port()), "8080"} <= set(exposed)


# ---- the Serve apps ---------------------------------------------------------------------------


def _builder(import_path: str):
    module_name, _, attribute = import_path.partition(":")
    require(module_name, importlib.util.find_spec(module_name) is not None)
    builder = getattr(importlib.import_module(module_name), attribute, None)
    assert callable(builder), f"{import_path} is not a callable app builder"
    return builder


def _check_args(builder, args: dict) -> None:
    """Validate args against the builder's pydantic argument model, when it declares one."""
    from pydantic import BaseModel

    parameters = list(inspect.signature(builder).parameters)
    hints = typing.get_type_hints(builder) if parameters else {}
    annotation = hints.get(parameters[0]) if parameters else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        annotation.model_validate(args)


def _applications() -> list[tuple[str, dict]]:
    return [(label, app) for label, config in serve_configs() for app in config["applications"]]


@pytest.mark.parametrize(("label", "app"), _applications(),
                         ids=[f"{label}:{app['name']}" for label, app in _applications()])
def test_serve_apps_import_and_take_their_args(label, app):
    args = app.get("args", {})
    if "model" in args:
        assert args["model"] in PRESETS, f"{label}: unknown model preset {args['model']!r}"
    assert args.get("router") in ROUTERS, f"{label}: router {args.get('router')!r}"
    if "replicas" in args:
        assert isinstance(args["replicas"], int) and args["replicas"] > 0
    _check_args(_builder(app["import_path"]), args)


def test_vllm_app_names_raykvs_connector_settings():
    (app,) = serve_files()["vllm-app.yaml"]["applications"]
    assert Path(app["args"]["model_source"]).is_absolute()  # a local path, nothing downloaded
    module = "cluster.serving.vllm_connector"
    require(module, (ROOT / "cluster" / "serving" / "vllm_connector.py").is_file())
    settings = importlib.import_module("cluster.serving.vllm_service").RaykvSettings
    settings.from_extra(app["args"]["connector"])  # ValueError on an unknown raykv.* key


def test_rayservices_deploy_the_serve_files():
    files = serve_files()
    by_service = {"raykv-serve": "raykv-app.yaml", "raykv-vllm": "vllm-app.yaml"}
    for _, doc in of_kind("RayService"):
        config = yaml.safe_load(doc["spec"]["serveConfigV2"])
        assert config == files[by_service[doc["metadata"]["name"]]], doc["metadata"]["name"]


def test_ray_up_deploys_the_serve_file_it_mounts():
    (deploy,) = [argv for command in ray_up()["head_start_ray_commands"]
                 for argv in invocations(command, "serve")]
    assert deploy[1] == "deploy"
    (remote_root, local_root), = ray_up()["file_mounts"].items()
    local = Path(deploy[2].replace(remote_root, local_root.rstrip("/") or ".", 1))
    assert (ROOT / local).resolve() == (MANIFESTS / "serve" / "raykv-app.yaml").resolve()


# ---- raykv commands -----------------------------------------------------------------------------


def test_the_manifests_start_raykv_once_per_cluster():
    starts = [argv for where, argv in raykv_invocations()
              if where != "manifests/README.md" and argv[1] == "start"]
    assert len(starts) == 1 + len(cluster_specs())  # ray up's head, each KubeRay head


def test_no_lifecycle_hook_stops_raykv():
    """`raykv stop` stops every node actor in the cluster (cluster.api._stop), so a hook that
    runs it when a pod stops would drop every worker's pages at a head restart (eviction,
    drain, a deleted pod), which GCS fault tolerance is there to survive."""
    from tests.manifests._manifests import _exec_commands

    for name, doc in kubernetes_docs():
        for where, container in containers(doc):
            for hook, handler in container.get("lifecycle", {}).items():
                for shell in _exec_commands(handler):
                    stops = [argv for argv in invocations(shell, "raykv")
                             if argv[1:2] == ["stop"]]
                    assert not stops, f"{name} {where}: {hook} runs {stops}"


@pytest.mark.parametrize(("where", "argv"), raykv_invocations(),
                         ids=[f"{w}:{' '.join(a[:2])}" for w, a in raykv_invocations()])
def test_raykv_commands_parse_with_the_cli(where, argv):
    from cluster.tools.cli import app

    group = typer.main.get_command(app)
    require(f"raykv {argv[1]}", argv[1] in group.commands)
    command = group.commands[argv[1]]
    command.make_context(f"raykv {argv[1]}", argv[2:])  # click raises on an unknown option


def _readme_kubectl() -> list[tuple[str, list[str]]]:
    """(the block, argv) of every kubectl command in manifests/README.md's code blocks."""
    return [(block, argv) for block in code_blocks(README.read_text())
            for argv in shell_invocations(block, "kubectl")]


def test_the_readmes_head_lookups_pick_one_clusters_head():
    """`kubectl get pod -l ray.io/node-type=head` lists every cluster's head (the RayCluster's
    and each RayService's): a lookup also selects ray.io/cluster, the RayCluster's name or a
    RayService's cluster, read from its status. kubectl keeps only the last -l it is given."""
    clusters = {doc["metadata"]["name"] for _, doc in of_kind("RayCluster")}
    lookups = 0
    for block, argv in _readme_kubectl():
        selectors = kubectl_selectors(argv)
        if not any("ray.io/node-type=head" in s for s in selectors):
            continue
        lookups += 1
        assert len(selectors) == 1, f"kubectl keeps the last of {selectors}"
        labels = dict(term.split("=", 1) for term in selectors[0].split(","))
        cluster = labels.get("ray.io/cluster")
        assert cluster, f"{shlex.join(argv)}: no ray.io/cluster"
        variable = re.fullmatch(r"\$\{?(\w+)\}?", cluster)
        if variable:  # set in the same block from a RayService's status
            assignment = re.search(rf"^{variable[1]}=\$\((kubectl get rayservice .*)\)$",
                                   block, flags=re.M)
            assert assignment and "rayClusterName" in assignment[1], block
        else:
            assert cluster in clusters, cluster
    assert lookups >= 2  # the RayCluster's head, and a RayService's


# ---- environment ------------------------------------------------------------------------------


def _code_text() -> str:
    return "\n".join(path.read_text() for folder in ("cluster", "actors")
                     for path in sorted((ROOT / folder).rglob("*.py")))


_EXPANSION = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)")  # Kubernetes' $(VAR); $$ escapes


def _expanded_only(container: dict) -> set[str]:
    """Env vars a container defines only to expand into another entry ($(NAME)): Kubernetes
    reads them, not the code."""
    values = " ".join(entry.get("value", "") for entry in container.get("env", []))
    return set(_EXPANSION.findall(values))


def _manifest_env_names() -> set[str]:
    names = {name for *_, pod_spec in all_pod_groups() for container in pod_spec["containers"]
             for name in env_of(container)
             if name.startswith("RAYKV_") and name not in _expanded_only(container)}
    names |= set(re.findall(r"\b(RAYKV_[A-Z_]+)=", " ".join(ray_up_commands())))
    names |= set(re.findall(r"^ENV (RAYKV_[A-Z_]+)=", DOCKERFILE.read_text(), flags=re.M))
    return names


@pytest.mark.parametrize("name", sorted(_manifest_env_names()))
def test_env_vars_are_ones_the_code_reads(name):
    code = _code_text()
    require(name, f'"{name}"' in code or f"'{name}'" in code)


def test_the_disk_dir_is_one_path_under_each_pods_disk_volume():
    storage_classes = {doc["metadata"]["name"] for _, doc in of_kind("StorageClass")}
    dirs = set()
    for label, group, _, pod_spec in all_pod_groups():
        container = pod_spec["containers"][0]
        disk_dir = env_of(container)["RAYKV_DISK_DIR"]["value"]
        dirs.add(disk_dir)
        mount = max((m for m in container["volumeMounts"]
                     if disk_dir.startswith(m["mountPath"].rstrip("/") + "/")),
                    key=lambda m: len(m["mountPath"]))
        volume = volume_at(pod_spec, container, mount["mountPath"])
        assert volume.get("emptyDir", {}).get("medium") != "Memory", f"{label} {group}: tmpfs"
        if has_gpu(pod_spec):  # a local NVMe volume of the pod's own
            claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
            assert claim["storageClassName"] in storage_classes, (label, group)
    dirs.add(re.search(r"^ENV RAYKV_DISK_DIR=(\S+)", DOCKERFILE.read_text(), flags=re.M)[1])
    dirs |= set(re.findall(r"RAYKV_DISK_DIR=(\S+?)'?(?:\s|$)", " ".join(ray_up_commands())))
    assert len(dirs) == 1, dirs


# ---- shared memory ----------------------------------------------------------------------------


def _host_bytes(spec: dict) -> int:
    """--host-bytes of the `raykv start` in the cluster's head (CacheConfig's default if none)."""
    (_, _, head_spec) = pod_groups(spec)[0]
    from tests.manifests._manifests import _exec_commands

    starts = [argv for shell in _exec_commands(head_spec) for argv in invocations(shell, "raykv")
              if argv[1] == "start"]
    assert len(starts) == 1, "the head should run `raykv start` once"
    argv = starts[0]
    if "--host-bytes" in argv:
        return parse_bytes(argv[argv.index("--host-bytes") + 1])
    return CacheConfig().host_bytes


def test_dev_shm_holds_the_object_store_and_the_host_tier():
    """CacheConfig.host_bytes (+ device_bytes: a CPU stand-in off GPUs) and Ray's object store
    live in /dev/shm; raykv refuses to start when it is smaller (a pod's default is 64 MiB)."""
    config = CacheConfig()
    for label, spec in cluster_specs():
        host_bytes = _host_bytes(spec)
        for group, params, pod_spec in pod_groups(spec):
            container = pod_spec["containers"][0]
            volume = volume_at(pod_spec, container, "/dev/shm")
            assert volume is not None, f"{label} {group}: /dev/shm is the pod's 64 MiB default"
            assert volume["emptyDir"]["medium"] == "Memory", (label, group)
            size_bytes = quantity_bytes(volume["emptyDir"]["sizeLimit"])
            needed = int(params["object-store-memory"]) + host_bytes + config.device_bytes
            assert size_bytes >= needed, f"{label} {group}: {size_bytes} < {needed}"
            limit = quantity_bytes(container["resources"]["limits"]["memory"])
            assert limit >= size_bytes, f"{label} {group}: shm is charged to the memory limit"


# ---- Redis ------------------------------------------------------------------------------------


def _secret_ref(env_entry: dict) -> tuple[str, str]:
    ref = env_entry["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


REDIS_SECRET = ("raykv-redis", "password")  # created by the operator (manifests/README.md)


def test_one_redis_for_gcs_fault_tolerance_and_the_directory():
    service = the("Service")
    secret_ref = REDIS_SECRET
    address = f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    (redis,) = the("Deployment")["spec"]["template"]["spec"]["containers"]
    assert _secret_ref(env_of(redis)["REDIS_PASSWORD"]) == secret_ref
    assert "$(REDIS_PASSWORD)" in redis["args"]
    for label, spec in cluster_specs():
        options = spec["gcsFaultToleranceOptions"]
        assert options["redisAddress"] == address, label
        ref = options["redisPassword"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == secret_ref, label
        for group, _, pod_spec in pod_groups(spec):
            env = env_of(pod_spec["containers"][0])
            url = urlsplit(env["RAYKV_REDIS_URL"]["value"])
            assert url.scheme == "redis" and f"{url.hostname}:{url.port}" == address
            variable = re.fullmatch(r"\$\((\w+)\)", url.password)[1]
            names = [entry["name"] for entry in pod_spec["containers"][0]["env"]]
            assert names.index(variable) < names.index("RAYKV_REDIS_URL"), (label, group)
            assert _secret_ref(env[variable]) == secret_ref, (label, group)


def test_kuberay_accepts_each_heads_redis_settings():
    """KubeRay (v1.7.0, utils/validation.go) refuses a cluster whose head container sets
    REDIS_PASSWORD or RAY_REDIS_ADDRESS, or whose head rayStartParams set redis-password, when
    gcsFaultToleranceOptions is set (it sets the GCS's from the options), and REDIS_USERNAME or
    redis-username ever: such a cluster never gets a pod."""
    for label, spec in cluster_specs():
        head = spec["headGroupSpec"]
        env = env_of(head["template"]["spec"]["containers"][0])  # KubeRay's Ray container
        refused_env, refused_params = {"REDIS_USERNAME"}, {"redis-username"}
        if spec.get("gcsFaultToleranceOptions"):
            refused_env |= {"REDIS_PASSWORD", "RAY_REDIS_ADDRESS"}
            refused_params |= {"redis-password"}
        assert not refused_env & set(env), f"{label}: head sets {refused_env & set(env)}"
        params = set(head.get("rayStartParams", {}))
        assert not refused_params & params, f"{label}: head sets {refused_params & params}"


def test_env_expansions_name_variables_defined_before_them():
    """Kubernetes expands $(VAR) in an env value only from entries above it in the same
    container (else it stays literal: a password of "$(VAR)"), in command and args from any."""
    for file_name, doc in kubernetes_docs():
        for where, container in containers(doc):
            defined: list[str] = []
            for entry in container.get("env", []):
                for name in _EXPANSION.findall(entry.get("value", "")):
                    assert name in defined, f"{file_name} {where}: {entry['name']} uses " \
                                            f"$({name}), not defined above it"
                defined.append(entry["name"])
            for argument in container.get("command", []) + container.get("args", []):
                for name in _EXPANSION.findall(argument):
                    assert name in defined, f"{file_name} {where}: $({name}) undefined"


def test_the_key_secret_comes_from_a_secret_never_a_literal():
    """RAYKV_KEY_SECRET (cluster/core/secrets.py) on every Ray pod, from a Kubernetes Secret."""
    for label, spec in cluster_specs():
        for group, _, pod_spec in pod_groups(spec):
            entry = env_of(pod_spec["containers"][0])["RAYKV_KEY_SECRET"]
            assert "value" not in entry, (label, group)
            assert _secret_ref(entry) == ("raykv-key-secret", "secret"), (label, group)
            # required: without it the pod waits, rather than run with a secret kept in Redis
            assert not entry["valueFrom"]["secretKeyRef"].get("optional"), (label, group)


# ---- one Ray, one raykv -----------------------------------------------------------------------


def test_one_ray_version_everywhere():
    import ray

    base = re.search(r"^ARG RAY_IMAGE=\S+:(\d+\.\d+\.\d+)-", DOCKERFILE.read_text(), flags=re.M)[1]
    pinned = re.search(r"ray\[[a-z,]+\]==(\S+?)\"", " ".join(ray_up()["setup_commands"]))[1]
    versions = {spec["rayVersion"] for _, spec in cluster_specs()} | {base, pinned}
    assert versions == {ray.__version__}


def test_images_are_this_raykv_version():
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as handle:
        version = tomllib.load(handle)["project"]["version"]
    for label, group, _, pod_spec in all_pod_groups():
        image = pod_spec["containers"][0]["image"]
        assert image.rsplit(":", 1)[1] == version, (label, group, image)


def test_the_dockerfile_copies_every_package():
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as handle:
        packages = tomllib.load(handle)["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = set(re.findall(r"^COPY \S+ (\w+) ", DOCKERFILE.read_text(), flags=re.M))
    assert {p.rstrip("*") for p in packages} <= copied


def test_the_build_context_leaves_out_every_venv():
    """The Dockerfile's ignore file (BuildKit reads <Dockerfile>.dockerignore beside it; a
    pattern is matched against the path from the context's root) leaves out the local venvs,
    make test's .venv-vllm (4.5 GB) among them, and none of what the Dockerfile copies."""
    ignore = DOCKERFILE.with_name(DOCKERFILE.name + ".dockerignore")
    patterns = [line.strip() for line in ignore.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert not [p for p in patterns if p.startswith("!")]  # no re-includes to reason about
    names = venv_names()
    assert {".venv", ".venv-vllm"} <= names
    for name in names:
        assert any(fnmatch.fnmatchcase(name, p.strip("/")) for p in patterns), name
    copied = re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", DOCKERFILE.read_text(), flags=re.M)
    for source in " ".join(copied).split():
        assert not any(fnmatch.fnmatchcase(source, p) for p in patterns), source


def _without_models(spec: dict) -> dict:
    """A vLLM cluster spec with raykv's image and without the weights volume."""
    spec = yaml.safe_load(yaml.safe_dump(spec))
    for _, _, pod_spec in pod_groups(spec):
        for container in pod_spec["containers"]:
            container["image"] = container["image"].replace("raykv-vllm:", "raykv:")
            mounts = [m for m in container.get("volumeMounts", []) if m["name"] != "models"]
            container["volumeMounts"] = mounts
        pod_spec["volumes"] = [v for v in pod_spec.get("volumes", []) if v["name"] != "models"]
    return spec


def test_rayservices_run_the_rayclusters_spec():
    base = the("RayCluster")["spec"]
    for _, doc in of_kind("RayService"):
        config = doc["spec"]["rayClusterConfig"]
        if doc["metadata"]["name"] == "raykv-vllm":
            assert config != base
            config = _without_models(config)
        assert config == base, doc["metadata"]["name"]
