"""No import cycle among the modules of cluster, actors and policies, package __init__s and
imports between the three packages included (the acyclic_siblings contract in pyproject.toml
sees cycles between siblings only). Imports inside functions and under TYPE_CHECKING count:
grimp records them all."""

from __future__ import annotations

from graphlib import CycleError, TopologicalSorter

import grimp

PACKAGES = ("cluster", "actors", "policies")

# Cycles this test tolerates, each as the set of its modules, with why; none is left. (Removed:
# actors.handles <-> the actor modules, cluster.core.elastic <-> cluster.core.pool,
# cluster.tools.tax <-> cluster.tools.tax_cli.)
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()


def find_cycle(imports: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated last), or None when acyclic."""
    try:
        TopologicalSorter(imports).prepare()
    except CycleError as error:
        return list(error.args[1])
    return None


def package_imports() -> dict[str, set[str]]:
    """Module -> the modules of PACKAGES it imports directly."""
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    return {module: set(graph.find_modules_directly_imported_by(module))
            for module in graph.modules}


def without_known(imports: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph with the imports inside each known cycle taken out."""
    return {module: {imported for imported in targets
                     if not any({module, imported} <= cycle for cycle in KNOWN_CYCLES)}
            for module, targets in imports.items()}


def test_find_cycle_names_a_cycle_and_passes_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    cycle = find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}


def test_the_packages_have_no_import_cycle():
    imports = package_imports()
    assert {"actors.handles", "cluster.core.pool", "policies.quota"} <= set(imports)
    cycle = find_cycle(without_known(imports))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_removed_cycles_stay_removed():
    imports = package_imports()
    actor_modules = {"actors.node_cache", "actors.controller", "actors.control_loop",
                     "actors.directory"}
    assert not imports["actors.handles"] & actor_modules
    assert "cluster.core.pool" not in imports["cluster.core.elastic"]
    assert "cluster.tools.tax_cli" not in imports["cluster.tools.tax"]
