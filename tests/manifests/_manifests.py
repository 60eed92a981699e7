"""The manifests under manifests/, loaded for the tests: KubeRay objects, cluster specs and pod
groups, Serve configs, the `ray up` YAML, and the `raykv ...` command lines they run.

Contracts still being built on main (issue 11: the Serve apps, `raykv start/stop/status/serve`,
the service reading RAYKV_REDIS_URL) are listed in PENDING. A check that needs one of them skips,
naming it, until it lands; once it exists the check runs. Empty PENDING once all have landed.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
SCHEMAS = ROOT.parent / "shared" / "schemas"
RAY_UP = MANIFESTS / "ray-up" / "aws.yaml"
DOCKERFILE = MANIFESTS / "Dockerfile"

PENDING: set[str] = set()  # every contract has landed: nothing may skip


def require(contract: str, present: bool) -> None:
    """Skip (naming it) while a pending contract is missing; fail if any other one is."""
    if present:
        return
    if contract in PENDING:
        pytest.skip(f"contract {contract!r} is not on this branch yet (issue 11, being built "
                    f"on main); this check runs once it lands")
    pytest.fail(f"the manifests use {contract!r}, which the code does not provide")


# ---- KubeRay objects ------------------------------------------------------------------------


def kubernetes_docs() -> list[tuple[str, dict]]:
    """(file name, object) for every object in manifests/kuberay/*.yaml."""
    docs = []
    for path in sorted((MANIFESTS / "kuberay").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def of_kind(kind: str) -> list[tuple[str, dict]]:
    return [(name, doc) for name, doc in kubernetes_docs() if doc["kind"] == kind]


def the(kind: str) -> dict:
    (found,) = [doc for _, doc in of_kind(kind)]
    return found


def cluster_specs() -> list[tuple[str, dict]]:
    """(label, RayCluster spec) for the RayCluster and each RayService's rayClusterConfig."""
    specs = [(f"RayCluster {doc['metadata']['name']}", doc["spec"])
             for _, doc in of_kind("RayCluster")]
    specs += [(f"RayService {doc['metadata']['name']}", doc["spec"]["rayClusterConfig"])
              for _, doc in of_kind("RayService")]
    return specs


def group_specs(spec: dict) -> list[tuple[str, dict]]:
    """(group name, group spec): the headGroupSpec, then each of workerGroupSpecs."""
    return [("head", spec["headGroupSpec"])] + [
        (group["groupName"], group) for group in spec.get("workerGroupSpecs", [])]


def pod_groups(spec: dict) -> list[tuple[str, dict, dict]]:
    """(group name, rayStartParams, pod spec): the head group, then each worker group."""
    head = spec["headGroupSpec"]
    groups = [("head", head.get("rayStartParams", {}), head["template"]["spec"])]
    groups += [(group["groupName"], group.get("rayStartParams", {}), group["template"]["spec"])
               for group in spec.get("workerGroupSpecs", [])]
    return groups


def all_pod_groups() -> list[tuple[str, str, dict, dict]]:
    return [(label, *group) for label, spec in cluster_specs() for group in pod_groups(spec)]


def has_gpu(pod_spec: dict) -> bool:
    return any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
               for c in pod_spec["containers"])


_KUBERAY_STANDARD = re.compile(r"^(cpu|memory|.*gpu.*)$", flags=re.I)  # not custom resources


def ray_resources(group: dict) -> dict[str, float]:
    """The custom Ray resources a group's pods offer, read as KubeRay (>= 1.5.1,
    updateRayStartParamsResources) reads the group's `resources` field to build `ray start
    --resources='{...}'`: cpu, memory and GPU keys aside, each quantity a number."""
    return {name: float(quantity) for name, quantity in group.get("resources", {}).items()
            if not _KUBERAY_STANDARD.match(name)}


def containers(doc: dict) -> list[tuple[str, dict]]:
    """(where, container) for every container and init container in a Kubernetes object."""
    found = []

    def walk(node, path):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    found.extend((f"{path}.{key}:{c.get('name')}", c) for c in value)
                else:
                    walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{path}[{index}]")

    walk(doc, doc["metadata"]["name"])
    return found


def env_of(container: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def volume_at(pod_spec: dict, container: dict, mount_path: str) -> dict | None:
    """The pod volume mounted at mount_path in the container, or None."""
    names = [m["name"] for m in container.get("volumeMounts", []) if m["mountPath"] == mount_path]
    if not names:
        return None
    (volume,) = [v for v in pod_spec.get("volumes", []) if v["name"] == names[0]]
    return volume


# ---- Serve configs and ray up -----------------------------------------------------------------


def serve_files() -> dict[str, dict]:
    return {path.name: yaml.safe_load(path.read_text())
            for path in sorted((MANIFESTS / "serve").glob("*.yaml"))}


def serve_configs() -> list[tuple[str, dict]]:
    """Every Serve config: the files in manifests/serve and each RayService's serveConfigV2."""
    configs = list(serve_files().items())
    for _, doc in of_kind("RayService"):
        label = f"RayService {doc['metadata']['name']}"
        configs.append((label, yaml.safe_load(doc["spec"]["serveConfigV2"])))
    return configs


def ray_up() -> dict:
    return yaml.safe_load(RAY_UP.read_text())


def venv_names() -> set[str]:
    """The local virtualenvs a build or a sync must leave out: the ones the Makefile makes
    (.venv, .venv-vllm: 4.5 GB, .venv-lmcache), any .venv* here, and a future .venv-*."""
    names = set(re.findall(r"^\w+\s*:?=\s*(\.venv[\w.-]*)\s*$", (ROOT / "Makefile").read_text(),
                           flags=re.M))
    names |= {path.name for path in ROOT.glob(".venv*") if path.is_dir()}
    return names | {".venv", ".venv-vllm", ".venv-next"}


# ---- command lines ----------------------------------------------------------------------------

_SEPARATORS = re.compile(r";|&&|\|\||\||\n|\bthen\b|\bdo\b")
_REDIRECT = re.compile(r"^\d*[<>]")
_SHELLS = (["/bin/bash", "-c"], ["/bin/sh", "-c"], ["sh", "-c"], ["bash", "-c"])


def _exec_commands(node) -> list[str]:
    """The shell strings of every `exec.command` (lifecycle hooks, probes) under node."""
    found: list[str] = []
    if isinstance(node, dict):
        command = node["exec"].get("command") if isinstance(node.get("exec"), dict) else None
        if command:
            found.append(command[-1] if command[:2] in _SHELLS else shlex.join(command))
        for value in node.values():
            found += _exec_commands(value)
    elif isinstance(node, list):
        for value in node:
            found += _exec_commands(value)
    return found


def ray_up_commands() -> list[str]:
    config = ray_up()
    keys = ("initialization_commands", "setup_commands", "head_setup_commands",
            "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")
    return [command for key in keys for command in config.get(key, [])]


def shell_commands() -> list[tuple[str, str]]:
    """(where, shell string) for every command the manifests run."""
    commands = [("ray up", command) for command in ray_up_commands()]
    commands += [(name, command) for name, doc in kubernetes_docs()
                 for command in _exec_commands(doc)]
    return commands


def invocations(shell: str, program: str) -> list[list[str]]:
    """argv of each simple command in `shell` that runs `program` (env assignments and
    redirections dropped), also where another command runs it: after `--` (kubectl exec) or
    in a quoted argument (ray exec "...")."""
    found = []
    for segment in _SEPARATORS.split(shell):
        try:
            words = [w for w in shlex.split(segment) if not _REDIRECT.match(w)]
        except ValueError:
            continue
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]
        if words and words[0] == program:
            found.append(words)
            continue
        if "--" in words:
            found += invocations(shlex.join(words[words.index("--") + 1:]), program)
        for word in words:
            if " " in word:
                found += invocations(word, program)
    return found


README = MANIFESTS / "README.md"


def readme_sections() -> dict[str, str]:
    """manifests/README.md's `## ` sections: heading (without the hashes) -> its text."""
    parts = re.split(r"^## (.+)$", README.read_text(), flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def readme_section(prefix: str) -> str:
    (text,) = [text for heading, text in readme_sections().items() if heading.startswith(prefix)]
    return text


def code_blocks(markdown: str) -> list[str]:
    """The shell code blocks of a piece of markdown, their `\\`-continued lines joined."""
    blocks = re.findall(r"^ *```(?:bash|sh|shell)\n(.*?)^ *```", markdown, flags=re.S | re.M)
    return [re.sub(r"\\\n\s*", " ", block) for block in blocks]


def substitutions(shell: str) -> tuple[str, list[str]]:
    """shell with each outermost `$(...)` replaced by a placeholder, and the contents of every
    `$(...)` (nested ones too), each likewise flattened."""
    flat, found, depth, start = [], [], 0, 0
    index = 0
    while index < len(shell):
        if shell.startswith("$(", index):
            if depth == 0:
                start = index + 2
            depth += 1
            index += 2
            continue
        if depth and shell[index] == ")":
            depth -= 1
            if depth == 0:
                inner, nested = substitutions(shell[start:index])
                found += [inner, *nested]
                flat.append("SUBSTITUTED")
            index += 1
            continue
        if depth == 0:
            flat.append(shell[index])
        index += 1
    return "".join(flat), found


def shell_invocations(shell: str, program: str) -> list[list[str]]:
    """invocations(), also of the commands in `$(...)` substitutions."""
    flat, inner = substitutions(shell)
    return [argv for part in (flat, *inner) for argv in invocations(part, program)]


def kubectl_selectors(argv: list[str]) -> list[str]:
    """The label selectors (-l, --selector) a kubectl command line passes, in order."""
    found = []
    for index, word in enumerate(argv):
        if word in ("-l", "--selector") and index + 1 < len(argv):
            found.append(argv[index + 1])
        elif word.startswith(("-l=", "--selector=")):
            found.append(word.split("=", 1)[1])
        elif word.startswith("-l") and len(word) > 2 and not word.startswith("--"):
            found.append(word[2:])
    return found


def raykv_invocations() -> list[tuple[str, list[str]]]:
    """(where, argv) of every `raykv ...` the manifests run, and those in the README's code."""
    found = [(where, argv) for where, shell in shell_commands()
             for argv in invocations(shell, "raykv")]
    readme = (MANIFESTS / "README.md").read_text()
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", readme, flags=re.S):
        found += [("manifests/README.md", argv) for argv in invocations(block, "raykv")]
    return found
