"""`raykv quota`: models and namespaces and their quotas, on the running service."""

from __future__ import annotations

import json
import os
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from cluster.core.sizing import format_bytes, parse_bytes
from cluster.tools.ops_cli import service_errors

quota_app = typer.Typer(help="Register models and namespaces and set their quotas (min, max "
                             "and weight, per tier and node) on the running service; no "
                             "restart needed.", no_args_is_help=True)

Min = Annotated[str, typer.Option("--min", help="never reclaimed below this, e.g. 1GiB")]
Max = Annotated[str | None, typer.Option("--max", help="never grows past this, e.g. 8GiB")]
Weight = Annotated[float, typer.Option("--weight", help="its share of a full tier")]
Priority = Annotated[str, typer.Option(
    "--priority", help="the namespace's eviction class: low, normal or high (when memory is "
    "freed across namespaces, lower classes give their pages first)")]
Address = Annotated[str | None, typer.Option(help="Ray cluster address (default: RAY_ADDRESS, "
                                                  "else the local cluster)")]
AsJson = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]


def _quota(min_text: str, max_text: str | None, weight: float, priority: str = "normal"):
    from policies.quota import Quota

    try:
        return Quota(parse_bytes(min_text), parse_bytes(max_text) if max_text else None,
                     weight, priority)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


def _connect(address: str | None) -> None:
    if address:
        os.environ["RAY_ADDRESS"] = address


@quota_app.command("model")
@service_errors
def model_command(
    name: Annotated[str, typer.Argument(help="a model preset (see `raykv size --help`)")],
    min_bytes: Min = "0", max_bytes: Max = None, weight: Weight = 1.0,
    address: Address = None,
) -> None:
    """Register a model (or change its quota)."""
    from cluster import ModelSpec, register_model

    try:
        spec = ModelSpec.preset(name)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="NAME") from None
    _connect(address)
    _show(register_model(spec, _quota(min_bytes, max_bytes, weight)), False)


@quota_app.command("namespace")
@service_errors
def namespace_command(
    name: Annotated[str, typer.Argument(help="the namespace (a tenant)")],
    min_bytes: Min = "0", max_bytes: Max = None, weight: Weight = 1.0,
    priority: Priority = "normal", address: Address = None,
) -> None:
    """Add a namespace (or change its quota and priority class)."""
    from cluster import add_namespace

    quota = _quota(min_bytes, max_bytes, weight, priority)
    _connect(address)
    try:
        registry = add_namespace(name, quota)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="NAME") from None
    _show(registry, False)


@quota_app.command("show")
@service_errors
def show_command(address: Address = None, as_json: AsJson = False) -> None:
    """The registered models and namespaces with their quotas."""
    from cluster import quotas

    _connect(address)
    _show(quotas(), as_json)


def _show(registry: dict, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(registry, indent=2))
        return
    table = Table(title=f"quotas (registry version {registry['version']}), per tier per node")
    for column in ("kind", "name", "min", "max", "weight", "priority"):
        table.add_column(column, justify="left" if column in ("kind", "name") else "right")
    for kind in ("models", "namespaces"):
        for name, quota in registry[kind].items():
            maximum = "-" if quota["max_bytes"] is None else format_bytes(quota["max_bytes"])
            table.add_row(kind[:-1], name, format_bytes(quota["min_bytes"]), maximum,
                          f"{quota['weight']:g}",
                          quota.get("priority", "normal") if kind == "namespaces" else "-")
    Console().print(table)
