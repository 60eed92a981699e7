"""The models and namespaces a running service knows, with their quotas.

Registered at run time (no restart): `register_model(spec, quota)` and `add_namespace(name,
quota)`. The controller keeps the registry and pushes it to every node actor, which applies
it to its elastic memory; a restarted controller takes it back from a node. Pools are per page
geometry, so models that share a geometry share a pool: their quotas add up there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.core.geometry import PageGeometry
from cluster.core.spec import ModelSpec
from policies.quota import Quota


@dataclass(slots=True)
class Registry:
    page_tokens: int
    models: dict[str, tuple[ModelSpec, Quota]] = field(default_factory=dict)
    namespaces: dict[str, Quota] = field(default_factory=dict)
    version: int = 0

    def is_registered(self, spec: ModelSpec) -> bool:
        """Whether the model is registered (False: not yet); ValueError when its name is
        registered with another geometry or dtype (its pages would go to a pool of their own,
        outside the model's quota, and never meet the model's)."""
        known = self.models.get(spec.name)
        if known is not None and known[0] != spec:
            raise ValueError(f"model {spec.name!r} is registered with another geometry: "
                             f"{known[0]}, not {spec}")
        return known is not None

    def register_model(self, spec: ModelSpec, quota: Quota | None = None) -> None:
        """Add a model, or change its quota (None keeps the one it has, or the default)."""
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"spec must be a ModelSpec, got {type(spec).__name__}")
        self.is_registered(spec)  # another geometry under this name: ValueError
        known = self.models.get(spec.name)
        self.models[spec.name] = (spec, quota or (known[1] if known else Quota()))
        try:  # models sharing a geometry add their quotas up: the sum must be a quota too
            self.pool_quotas()
        except ValueError:
            if known is None:
                del self.models[spec.name]
            else:
                self.models[spec.name] = known
            raise
        self.version += 1

    def add_namespace(self, name: str, quota: Quota | None = None) -> None:
        """Add a namespace, or change its quota (None keeps the one it has)."""
        if not isinstance(name, str) or not name or len(name) > 128:
            raise ValueError(f"a namespace is a non-empty string of at most 128 characters, "
                             f"got {name!r}")
        self.namespaces[name] = quota or self.namespaces.get(name, Quota())
        self.version += 1

    def check_namespace(self, name: str) -> None:
        if name not in self.namespaces:
            raise ValueError(f"unknown namespace {name!r}; known: {sorted(self.namespaces)}. "
                             "Add it with cluster.add_namespace() or `raykv quota namespace`.")

    def pool_quotas(self) -> tuple[dict[str, Quota], dict[str, str]]:
        """(quota per pool holder, the models' names per holder): holders are page geometry
        names; models sharing a geometry add their quotas up."""
        quotas: dict[str, Quota] = {}
        names: dict[str, list[str]] = {}
        for name, (spec, quota) in sorted(self.models.items()):
            holder = PageGeometry.of(spec, self.page_tokens).name
            quotas[holder] = quotas[holder].combined(quota) if holder in quotas else quota
            names.setdefault(holder, []).append(name)
        return quotas, {holder: "+".join(models) for holder, models in names.items()}

    def describe(self) -> dict:
        def q(quota: Quota) -> dict:
            return {"min_bytes": quota.min_bytes, "max_bytes": quota.max_bytes,
                    "weight": quota.weight, "priority": quota.priority}

        return {"version": self.version,
                "models": {n: {"spec": repr(s), **q(quota)}
                           for n, (s, quota) in sorted(self.models.items())},
                "namespaces": {n: q(quota) for n, quota in sorted(self.namespaces.items())}}
