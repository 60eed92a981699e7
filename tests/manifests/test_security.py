"""The manifests are secure by default:

- no secret ships in them: every password and key comes from a Kubernetes Secret that the
  operator creates (with a documented command that generates it), or, on `ray up`, from a
  file the head generates once (0600);
- every Serve config of raykv's app that binds beyond loopback (or serves tenants) has API
  keys wired, and the app refuses that config without them;
- a NetworkPolicy admits raykv's page-server ports, and the ports the OS picks (vLLM's KV-event
  sockets among them), from raykv's Ray pods only, and leaves Ray's fixed ports as they were;
  its page ports are the code's (CacheConfig.page_port); a second opens Ray's metrics ports
  (44217, 44227) on the head only."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from cluster.core.config import CacheConfig
from cluster.serving.access import (
    Access,
    KeysRequired,
    api_keys_from_env,
    is_loopback,
    require_keys_for_bind,
    require_keys_for_namespaces,
)
from tests.manifests._manifests import (
    MANIFESTS,
    cluster_specs,
    code_blocks,
    env_of,
    invocations,
    kubernetes_docs,
    of_kind,
    pod_groups,
    ray_up,
    raykv_invocations,
    readme_section,
    serve_configs,
)

RAYKV_APP = "cluster.serving.app:build_app"
SECRETS_FILE = "/home/ubuntu/raykv/.secrets/raykv.env"  # ray up's, generated on the head
PAGE_PORT = 7460  # CacheConfig.page_port's default (issue 17); node actors on a host: +0..+15
PAGE_PORTS_PER_HOST = 16
EPHEMERAL_FIRST = 30000  # the policy's range for ports the OS picks (Linux's: 32768-60999)
HEAD_METRICS_PORTS = {44217, 44227}  # Ray's autoscaler and dashboard metrics, on the head
SECRET_NAMES = re.compile(r"PASSWORD|SECRET|KEYS?$|TOKEN")
AUTH_SECRET = "raykv-ray-auth"  # authOptions.secretName (test_gpu_and_auth.py)
HEX_LITERAL = re.compile(r"(?<![0-9a-fA-F])[0-9a-fA-F]{24,}(?![0-9a-fA-F])")


def _walk(node, path=()):
    """(path, dict) for every dict under node."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, (*path, index))


def _secret_refs() -> list[tuple[str, dict]]:
    return [(f"{name}:{doc['metadata']['name']}", node["secretKeyRef"])
            for name, doc in kubernetes_docs() for _, node in _walk(doc)
            if isinstance(node.get("secretKeyRef"), dict)]


def _manifest_texts() -> list[tuple[str, str]]:
    return [(str(path.relative_to(MANIFESTS)), path.read_text())
            for path in sorted(MANIFESTS.rglob("*")) if path.is_file()]


# ---- no literal secrets ----------------------------------------------------------------------


def test_no_secret_object_ships():
    kinds = [(name, doc["kind"]) for name, doc in kubernetes_docs()]
    assert not [k for k in kinds if k[1] == "Secret"], "a Secret in the manifests ships a value"


def test_every_referenced_secret_is_required_and_generated_by_a_documented_command():
    readme = " ".join((MANIFESTS / "README.md").read_text().split())
    refs = _secret_refs()
    assert {(r["name"], r["key"]) for _, r in refs} >= {
        ("raykv-redis", "password"), ("raykv-key-secret", "secret"), ("raykv-api-keys", "keys")}
    for where, ref in refs:
        assert not ref.get("optional"), f"{where}: {ref['name']} is optional"
        command = re.search(rf"kubectl create secret generic {ref['name']} "
                            rf"--from-literal={ref['key']}=(.{{0,40}})", readme)
        assert command, f"manifests/README.md does not say how to create {ref['name']}"
        assert "$(openssl rand -hex" in command[1], command[0]  # generated, never typed in


def _referenced_secrets() -> dict[str, set[str]]:
    """Secret name -> where: every Secret a manifest names (secretKeyRef, a `secret` volume,
    authOptions.secretName or any other secretName)."""
    found: dict[str, set[str]] = {}
    for name, doc in kubernetes_docs():
        where = f"{name}:{doc['metadata']['name']}"
        for _, node in _walk(doc):
            if isinstance(node.get("secretKeyRef"), dict):
                found.setdefault(node["secretKeyRef"]["name"], set()).add(where)
            if isinstance(node.get("secretName"), str):  # a `secret` volume's too
                found.setdefault(node["secretName"], set()).add(where)
    return found


def _created_secrets(markdown: str) -> dict[str, set[str]]:
    """Secret name -> its keys, from the `kubectl create secret generic` lines of a piece of
    markdown's shell code blocks."""
    created: dict[str, set[str]] = {}
    for block in code_blocks(markdown):
        for argv in invocations(block, "kubectl"):
            if argv[1:4] == ["create", "secret", "generic"]:
                keys = {a.split("=", 2)[1] for a in argv[5:] if a.startswith("--from-literal=")}
                created.setdefault(argv[4], set()).update(keys)
    return created


def test_path_2_creates_every_secret_a_manifest_names():
    """The Secrets go first (the pods wait for them): Path 2's commands create every one, the
    Ray token's too (KubeRay does not create a Secret that authOptions.secretName names)."""
    created = _created_secrets(readme_section("Path 2:"))
    referenced = _referenced_secrets()
    assert {"raykv-redis", "raykv-key-secret", "raykv-api-keys", AUTH_SECRET} <= set(referenced)
    for secret, where in referenced.items():
        assert secret in created, f"Path 2 does not create {secret} (named in {sorted(where)})"
    for _, ref in _secret_refs():
        assert ref["key"] in created[ref["name"]], ref
    assert created[AUTH_SECRET] == {"auth_token"}  # the key KubeRay reads the token from


def test_paths_3_and_3b_point_to_path_2s_secrets_and_apply_the_policy():
    for heading in ("Path 3:", "Path 3b:"):
        section = readme_section(heading)
        assert re.search(r"Secrets of Path 2", section), f"{heading} does not name the Secrets"
        applied = [argv for block in code_blocks(section)
                   for argv in invocations(block, "kubectl") if argv[1] == "apply"]
        files = [argv[i + 1] for argv in applied for i, a in enumerate(argv) if a == "-f"]
        policy = "manifests/kuberay/network-policy.yaml"
        assert policy in files, f"{heading} does not apply the NetworkPolicy"
        service = next(f for f in files if "rayservice" in f)
        assert files.index(policy) < files.index(service), heading


def test_secret_env_vars_come_from_secrets_never_literals():
    checked = set()
    for name, doc in kubernetes_docs():
        for path, node in _walk(doc):
            if len(path) >= 2 and path[-2] == "env" and SECRET_NAMES.search(node["name"]):
                assert "value" not in node, (name, node["name"])
                assert "secretKeyRef" in node["valueFrom"], (name, node["name"])
                checked.add(node["name"])
    # REDIS_PASSWORD: Redis's own container; RAYKV_REDIS_PASSWORD: the Ray pods' (KubeRay
    # refuses REDIS_PASSWORD in a head with gcsFaultToleranceOptions)
    assert checked == {"REDIS_PASSWORD", "RAYKV_REDIS_PASSWORD", "RAYKV_KEY_SECRET",
                       "RAYKV_API_KEYS"}


def test_no_literal_password_or_key_in_any_manifest_file():
    for name, text in _manifest_texts():
        assert "change-me" not in text, name
        assert not re.search(r"^\s*(stringData|data):", text, flags=re.M), name
        assert not HEX_LITERAL.search(text), (name, HEX_LITERAL.search(text)[0])
        for password in re.findall(r"redis://:([^@\s]+)@", text):
            assert re.fullmatch(r"\$\(\w+\)|PASSWORD", password), (name, password)
        for argument in re.findall(r"--requirepass[\"',\s]+([^\"',\s]+)", text):
            assert argument == "$(REDIS_PASSWORD)", (name, argument)


# ---- ray up: secrets generated on the head ---------------------------------------------------


def _generator() -> str:
    (command,) = [c for c in ray_up()["head_setup_commands"] if SECRETS_FILE in c]
    return command


def _source(path: Path) -> dict[str, str]:
    shell = f"set -a; . {shlex.quote(str(path))}; set +a; env -0"
    out = subprocess.run(["bash", "-c", shell], capture_output=True, check=True,
                         env={"PATH": os.environ["PATH"]}).stdout.decode()
    return dict(item.split("=", 1) for item in out.split("\0") if "=" in item)


def test_ray_up_generates_its_secrets_once_private_and_valid(tmp_path, monkeypatch):
    root = tmp_path / "raykv"
    command = _generator().replace("/home/ubuntu/raykv", str(root))
    subprocess.run(["bash", "-c", command], check=True)
    path = root / ".secrets" / "raykv.env"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    env = _source(path)
    assert re.fullmatch(r"[0-9a-f]{64}", env["RAYKV_KEY_SECRET"])
    monkeypatch.setenv("RAYKV_API_KEYS", env["RAYKV_API_KEYS"])
    (key, namespace), = api_keys_from_env().items()
    assert namespace == "default" and re.fullmatch(r"[0-9a-f]{48}", key)
    first = path.read_bytes()
    subprocess.run(["bash", "-c", command], check=True)
    assert path.read_bytes() == first  # made once: a re-run of `ray up` keeps it


def test_ray_up_starts_ray_and_raykv_with_the_secrets():
    config = ray_up()
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    started = [c for c in starts
               if any(argv[1] == "start" for program in ("ray", "raykv")
                      for argv in invocations(c, program))]
    assert len(started) == 3  # the head's Ray and raykv, the workers' Ray
    for command in started:
        assert command.startswith(f"set -a; . {SECRETS_FILE}; set +a;") or \
            f"; set -a; . {SECRETS_FILE}; set +a;" in command, command
    mounted = set(config["file_mounts"])
    assert any(SECRETS_FILE.startswith(remote.rstrip("/") + "/") for remote in mounted)
    assert ".secrets" not in config.get("rsync_exclude", [])  # it goes to the workers


# ---- API keys wired wherever raykv's app needs them -------------------------------------------


def _raykv_apps() -> list[tuple[str, dict, dict]]:
    return [(label, config, app) for label, config in serve_configs()
            for app in config["applications"] if app["import_path"] == RAYKV_APP]


def _namespaces(args: dict) -> set[str]:
    return {"default", *args.get("admission", {}).get("tenants", {}),
            *args.get("api_keys", {}).values()}


def _needs_keys(config: dict, app: dict) -> bool:
    host = config.get("http_options", {}).get("host")
    return not is_loopback(host) or _namespaces(app.get("args", {})) != {"default"}


def _pods_wire_keys(label: str) -> bool:
    specs = dict(cluster_specs())
    return all(env_of(pod_spec["containers"][0]).get("RAYKV_API_KEYS", {}).get("valueFrom", {})
               .get("secretKeyRef") for _, _, pod_spec in pod_groups(specs[label]))


def _ray_up_wires_keys(name: str) -> bool:
    deployed = [argv[2] for c in ray_up()["head_start_ray_commands"]
                for argv in invocations(c, "serve") if argv[1] == "deploy"]
    return any(path.endswith(f"/{name}") for path in deployed) and \
        "RAYKV_API_KEYS=" in _generator()


def test_the_raykv_app_configs_exist_and_bind_beyond_loopback():
    apps = _raykv_apps()
    assert {label for label, *_ in apps} == {"raykv-app.yaml", "RayService raykv-serve"}
    assert all(_needs_keys(config, app) for _, config, app in apps)


@pytest.mark.parametrize(("label", "config", "app"), _raykv_apps(),
                         ids=[label for label, *_ in _raykv_apps()])
def test_serve_configs_that_need_keys_have_them_wired(label, config, app):
    assert "api_keys" not in app.get("args", {}), f"{label}: keys typed into the config"
    if not _needs_keys(config, app):
        return
    wired = _pods_wire_keys(label) if label.startswith("RayService") else _ray_up_wires_keys(label)
    assert wired, f"{label} binds {config['http_options']['host']} without API keys wired"


@pytest.mark.parametrize(("label", "config", "app"), _raykv_apps(),
                         ids=[label for label, *_ in _raykv_apps()])
def test_the_app_refuses_these_configs_without_keys_and_takes_them_with(label, config, app,
                                                                         monkeypatch):
    """What build_app and each ingress replica check, on the config's own host and args."""
    from cluster.serving.app import AppArgs

    def check(args: AppArgs) -> None:
        access = Access.of(args.api_keys)
        require_keys_for_bind(access, config["http_options"]["host"])
        require_keys_for_namespaces(access, _namespaces(app["args"]))

    monkeypatch.delenv("RAYKV_API_KEYS", raising=False)
    with pytest.raises(KeysRequired, match="RAYKV_API_KEYS"):
        check(AppArgs.model_validate(app["args"]))
    monkeypatch.setenv("RAYKV_API_KEYS", json.dumps({os.urandom(24).hex(): "default"}))
    check(AppArgs.model_validate(app["args"]))  # the env, as the Secret provides it


# ---- the NetworkPolicy of the page servers ---------------------------------------------------

# networking.k8s.io/v1 NetworkPolicy as the Kubernetes API defines it (the fields it has),
# closed to any other field, as kubectl's strict field validation is.
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
    "matchExpressions": {"type": "array", "items": {
        "type": "object", "additionalProperties": False, "required": ["key", "operator"],
        "properties": {"key": {"type": "string"},
                       "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                       "values": {"type": "array", "items": {"type": "string"}}}}}}}
_PEERS = {"type": "array", "items": {
    "type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
        "podSelector": _SELECTOR, "namespaceSelector": _SELECTOR,
        "ipBlock": {"type": "object", "additionalProperties": False, "required": ["cidr"],
                    "properties": {"cidr": {"type": "string"},
                                   "except": {"type": "array", "items": {"type": "string"}}}}}}}
_PORTS = {"type": "array", "items": {
    "type": "object", "additionalProperties": False, "properties": {
        "protocol": {"enum": ["TCP", "UDP", "SCTP"]},
        "port": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 65535},
                           {"type": "string"}]},
        "endPort": {"type": "integer", "minimum": 1, "maximum": 65535}}}}
NETWORK_POLICY_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "networking.k8s.io/v1"}, "kind": {"const": "NetworkPolicy"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "additionalProperties": False, "required": ["podSelector"],
                 "properties": {
                     "podSelector": _SELECTOR,
                     "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}},
                     "ingress": {"type": "array", "items": {
                         "type": "object", "additionalProperties": False,
                         "properties": {"from": _PEERS, "ports": _PORTS}}},
                     "egress": {"type": "array", "items": {
                         "type": "object", "additionalProperties": False,
                         "properties": {"to": _PEERS, "ports": _PORTS}}}}}}}


def test_the_network_policies_match_the_networking_v1_schema():
    import jsonschema

    for policy in _policies():
        jsonschema.validate(policy, NETWORK_POLICY_SCHEMA, cls=jsonschema.Draft7Validator)
        for rule in policy["spec"]["ingress"]:
            for entry in rule.get("ports", []):
                if "endPort" in entry:  # the API's rule: a numeric port, endPort not below it
                    assert isinstance(entry["port"], int) and entry["endPort"] >= entry["port"]
    broken = json.loads(json.dumps(_policy()))
    broken["spec"]["ingress"][0]["from"][0]["podSelectr"] = {}
    with pytest.raises(jsonschema.ValidationError, match="podSelectr"):
        jsonschema.validate(broken, NETWORK_POLICY_SCHEMA, cls=jsonschema.Draft7Validator)


PAGE_POLICY = "raykv-page-servers"  # the policy that selects every Ray pod


def _policies() -> list[dict]:
    return [doc for _, doc in of_kind("NetworkPolicy")]


def _policy() -> dict:
    (policy,) = [doc for doc in _policies() if doc["metadata"]["name"] == PAGE_POLICY]
    return policy


def _ray_pod_labels() -> list[tuple[str, dict]]:
    """(where, labels) of each Ray pod: its template's, and KubeRay's ray.io/is-ray-node and
    ray.io/node-type (head or worker)."""
    found = []
    for label, spec in cluster_specs():
        templates = [("head", spec["headGroupSpec"]["template"])]
        templates += [("worker", group["template"]) for group in spec.get("workerGroupSpecs", [])]
        found += [(f"{label} {node_type}",
                   {**t.get("metadata", {}).get("labels", {}), "ray.io/is-ray-node": "yes",
                    "ray.io/node-type": node_type}) for node_type, t in templates]
    return found


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) == {"matchLabels"}, selector  # the only form used here
    return selector["matchLabels"].items() <= labels.items()


def _covers(rule: dict, port: int, protocol: str = "TCP") -> bool:
    for entry in rule.get("ports", [{}]):
        if entry.get("protocol", "TCP") != protocol:
            continue
        first = entry.get("port", 1)
        if first <= port <= entry.get("endPort", first if "port" in entry else 65535):
            return True
    return False


def _rules(labels: dict) -> list[dict]:
    """The ingress rules a pod with these labels gets: those of every policy selecting it
    (NetworkPolicies add up)."""
    return [rule for policy in _policies() if _selects(policy["spec"]["podSelector"], labels)
            for rule in policy["spec"].get("ingress", [])]


def _from_ray_pods_only(rule: dict) -> bool:
    ray_pods = [labels for _, labels in _ray_pod_labels()]
    peers = rule.get("from")
    return bool(peers) and all(
        set(peer) == {"podSelector"}  # no ipBlock, no other namespace
        and all(_selects(peer["podSelector"], labels) for labels in ray_pods)
        and _selects(peer["podSelector"], _policy()["spec"]["podSelector"]["matchLabels"])
        for peer in peers)


def test_the_policies_select_every_ray_pod_and_no_other():
    for policy in _policies():
        assert policy["spec"]["policyTypes"] == ["Ingress"], policy["metadata"]["name"]
        for _, doc in of_kind("Deployment"):  # Redis
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert not _selects(policy["spec"]["podSelector"], labels)
    for where, labels in _ray_pod_labels():
        assert _selects(_policy()["spec"]["podSelector"], labels), where


def test_the_page_ports_are_admitted_from_ray_pods_only():
    page_ports = range(PAGE_PORT, PAGE_PORT + PAGE_PORTS_PER_HOST)
    for where, labels in _ray_pod_labels():
        for rule in _rules(labels):
            if any(_covers(rule, port) for port in page_ports):
                assert _from_ray_pods_only(rule), f"{where}: page ports admitted from anywhere"
    page_rules = [rule for rule in _policy()["spec"]["ingress"] if rule.get("from")]
    assert all(_covers(page_rules[0], port) for port in page_ports)
    assert not _covers(page_rules[0], PAGE_PORT - 1)
    assert not _covers(page_rules[0], PAGE_PORT + PAGE_PORTS_PER_HOST)


def test_the_fixed_ports_stay_open_as_before():
    """Serve's 8000, Ray's fixed ports, the dashboard (KubeRay's operator), the metrics port
    Prometheus scrapes (8080) and the dashboard agent: from anywhere, on every Ray pod; so are
    UDP and the ports below the OS's range."""
    page_ports = range(PAGE_PORT, PAGE_PORT + PAGE_PORTS_PER_HOST)
    for where, labels in _ray_pod_labels():
        open_rules = [rule for rule in _rules(labels) if not rule.get("from")]
        for port in (1, 6379, 8000, 8076, 8080, 8265, 10001, 10002, 19999, 52365,
                     PAGE_PORT - 1, PAGE_PORT + PAGE_PORTS_PER_HOST, EPHEMERAL_FIRST - 1):
            assert any(_covers(rule, port) for rule in open_rules), (where, port)
        for port in (1, 8000, 40000, 65535):
            assert any(_covers(rule, port, "UDP") for rule in open_rules), (where, port)
        assert not any(_covers(rule, port) for rule in open_rules for port in page_ports)


def test_the_os_assigned_ports_are_admitted_from_ray_pods_only():
    """raykv's relays of vLLM's KV events, and vLLM's own KV-event sockets where vLLM serves
    them (no authentication; their events carry prompts' token ids), bind ports the OS picks,
    as do Serve's direct-ingress ports and Ray's internal ones: from raykv's Ray pods only,
    but for the dashboard agent's port and, on the head, Ray's metrics ports."""
    # (tests/vllm/test_engine_events.py: raykv's relays bind `tcp://<node>:*`.)
    for where, labels in _ray_pod_labels():
        public = {52365} | (HEAD_METRICS_PORTS if labels["ray.io/node-type"] == "head" else set())
        for port in (EPHEMERAL_FIRST, 30500, 32768, 40000, *HEAD_METRICS_PORTS, 44216, 44218,
                     52364, 52366, 60999, 65535):
            rules = [rule for rule in _rules(labels) if _covers(rule, port)]
            assert rules, (where, port)
            if port in public:
                continue
            for rule in rules:
                assert _from_ray_pods_only(rule), f"{where}: port {port} admitted from anywhere"


def test_the_metrics_ports_are_open_on_the_head_only():
    """Ray's autoscaler (its monitor; KubeRay runs it in the head pod) and dashboard export
    metrics on 44217 and 44227, on the head only: open there for Prometheus, and on the workers
    OS-picked ports like the rest, from raykv's Ray pods only. Every Ray pod's metrics port
    (8080, the one the README has Prometheus scrape) stays open from anywhere."""
    from ray.autoscaler._private.constants import AUTOSCALER_METRIC_PORT
    from ray.dashboard.consts import DASHBOARD_METRIC_PORT

    assert {AUTOSCALER_METRIC_PORT, DASHBOARD_METRIC_PORT} == HEAD_METRICS_PORTS
    heads = 0
    for where, labels in _ray_pod_labels():
        head = labels["ray.io/node-type"] == "head"
        heads += head
        for port in HEAD_METRICS_PORTS:
            rules = [rule for rule in _rules(labels) if _covers(rule, port)]
            if head:
                assert any(not rule.get("from") for rule in rules), (where, port)
            else:
                assert rules and all(_from_ray_pods_only(rule) for rule in rules), (where, port)
    assert heads == len(cluster_specs())
    for where, labels in _ray_pod_labels():
        assert any(_covers(rule, 8080) and not rule.get("from") for rule in _rules(labels)), where


def test_the_page_ports_are_the_codes():
    policy = _policy()["spec"]
    (page_rule,) = [rule for rule in policy["ingress"]
                    if rule.get("from") and _covers(rule, PAGE_PORT)]
    (entry,) = page_rule["ports"]
    assert (entry["port"], entry["endPort"]) == (PAGE_PORT, PAGE_PORT + PAGE_PORTS_PER_HOST - 1)
    exposed = re.search(r"^EXPOSE .*\b(\d+)-(\d+)\b", (MANIFESTS / "Dockerfile").read_text(),
                        flags=re.M)
    assert exposed and (int(exposed[1]), int(exposed[2])) == (entry["port"], entry["endPort"])
    for where, argv in raykv_invocations():
        if "--page-port" in argv:
            assert int(argv[argv.index("--page-port") + 1]) == PAGE_PORT, where
    if "page_port" not in CacheConfig.model_fields:
        pytest.skip("CacheConfig.page_port is not on this branch yet (issue 17, the page "
                    "server's fixed port); the policy's ports are checked against 7460 only")
    assert CacheConfig().page_port == PAGE_PORT
