"""`raykv start`, `raykv stop` and `raykv status`: the service on an existing Ray cluster."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from cluster.core.sizing import format_bytes, parse_bytes

Address = Annotated[str | None, typer.Option(help="Ray cluster address ('auto': the one this "
                                                  "machine is part of; default RAY_ADDRESS)")]


def service_errors(command: Callable) -> Callable:
    """A command that prints why it could not reach Ray or raykv (the hint of what to do
    included) and exits 1, rather than a traceback."""
    from cluster.core.errors import ServiceNotRunning

    @functools.wraps(command)
    def wrapped(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (ConnectionError, ServiceNotRunning) as error:
            Console(stderr=True).print(f"[red]{error}[/]", highlight=False)
            raise typer.Exit(1) from None

    return wrapped


def _attach(address: str | None) -> None:
    """Join the Ray cluster (token authentication included: cluster.api.join_ray)."""
    from cluster.api import join_ray

    join_ray(address)


def start_command(
    address: Address = None,
    host_bytes: Annotated[str, typer.Option(help="host (shared memory) tier per node")] = "1GiB",
    device_bytes: Annotated[str, typer.Option(
        help="device (VRAM) tier per GPU, outside vLLM's gpu_memory_utilization (the node "
             "logs the largest the engines may use); a CPU stand-in on GPU-less nodes")]
    = "256MiB",
    disk_bytes: Annotated[str, typer.Option(help="disk tier per node")] = "4GiB",
    disk_dir: Annotated[str | None, typer.Option(help="disk tier directory on every node "
                                                      "(default: RAYKV_DISK_DIR, else per user)")]
    = None,
    redis_url: Annotated[str | None, typer.Option(help="Redis for the directory's write-behind "
                                                       "(default: RAYKV_REDIS_URL)")] = None,
    page_tokens: Annotated[int, typer.Option(help="tokens per page")] = 256,
    shards: Annotated[int, typer.Option(help="directory shards")] = 1,
    namespaces: Annotated[str, typer.Option(help="comma-separated namespaces to start with")]
    = "default",
    page_port: Annotated[int, typer.Option(help="the data plane's first port (each node "
                                                "takes the first free of 16); 0: any")] = 7460,
) -> None:
    """Start the cache service (directory, node actors, controller) on a running Ray cluster
    and return. Idempotent; a service already running with another config is an error. Each
    step waits RAYKV_START_TIMEOUT_S seconds (default 120) for its answer."""
    from cluster import start
    from cluster.api import start_timeout_s

    try:
        start_timeout_s()  # RAYKV_START_TIMEOUT_S, refused before anything starts
        config = start_config(dict(host_bytes=host_bytes, device_bytes=device_bytes,
                                   disk_bytes=disk_bytes, disk_dir=disk_dir,
                                   redis_url=redis_url, page_tokens=page_tokens,
                                   shards=shards, namespaces=namespaces,
                                   page_port=page_port))
    except ValueError as error:  # a bad size, a setting CacheConfig refuses, a bad timeout
        raise typer.BadParameter(str(error)) from None
    _attach(address)
    try:
        started = start(config)
    except TimeoutError as error:  # a step that did not answer: what and what to set
        Console(stderr=True).print(f"[red]{error}[/red]")
        raise typer.Exit(1) from None
    Console().print(f"raykv running on {len(started['nodes'])} node(s); "
                    f"`raykv status` shows it")


def start_config(options: dict):
    """The CacheConfig `raykv start` builds from its options (click's params: every option,
    by name, as the command line gives it; `address` is not read). A Serve app's `cache`
    argument that equals it lets the app and `raykv start` come up in either order."""
    from cluster import CacheConfig

    settings = dict(host_bytes=parse_bytes(options["host_bytes"]),
                    device_bytes=parse_bytes(options["device_bytes"]),
                    disk_bytes=parse_bytes(options["disk_bytes"]),
                    page_tokens=options["page_tokens"], num_directory_shards=options["shards"],
                    namespaces=tuple(n.strip() for n in options["namespaces"].split(",")
                                     if n.strip()))
    for name in ("disk_dir", "redis_url"):
        if options.get(name):
            settings[name] = options[name]
    if options.get("page_port") is not None:  # 0 is a setting too: any free port
        settings["page_port"] = options["page_port"]
    return CacheConfig(**settings)


def stop_command(
    address: Address = None,
    purge: Annotated[bool, typer.Option("--purge", help="also remove every node's disk slab "
                                                        "files (their pages are lost)")] = False,
) -> None:
    """Stop the cache service's actors on the cluster (disk pages stay for the next start,
    unless --purge)."""
    from cluster import purge as purge_service
    from cluster import stop

    _attach(address)
    (purge_service if purge else stop)()
    Console().print("raykv stopped" + (", disk slabs removed" if purge else ""))


def status_command(
    address: Address = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of tables")]
    = False,
) -> None:
    """The nodes, each tier's use against its capacity, hit ratios per tier, the top
    prefixes, the models and namespaces with their quotas, and the rates raykv's router
    measured online (fetch paths, each engine replica's prefill)."""
    from cluster.api import status
    from cluster.tools.rates_status import rates_tables, routing_rates

    _attach(address)
    report = status()
    report["routing_rates"] = routing_rates()
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
        return
    console = Console()
    for table in (_nodes_table(report), _tiers_table(report), _prefix_table(report),
                  _quota_table(report), *rates_tables(report["routing_rates"])):
        if table is not None:
            console.print(table)


def _nodes_table(report: dict) -> Table:
    table = Table(title=f"raykv nodes (page_tokens {report['config']['page_tokens']})")
    for column in ("node", "pages dev/host/disk", "gets", "hit pages", "miss pages",
                   "hit ratio", "leases", "pinned"):
        table.add_column(column, justify="left" if column == "node" else "right")
    for node in report["nodes"]:
        if "error" in node:
            table.add_row(node["node_id"][:12], f"[red]{node['error'][:60]}[/]", *[""] * 6)
            continue
        pages = node["pages"]
        table.add_row(node["node_id"][:12], f"{pages['device']}/{pages['host']}/{pages['disk']}",
                      str(node["gets"]), str(node["hits_pages"]), str(node["misses_pages"]),
                      f"{node['hit_ratio']:.0%}", str(node["leases"]),
                      str(node.get("pins", {}).get("pinned_pages", 0)))
    return table


def _tiers_table(report: dict) -> Table:
    table = Table(title="tiers (all nodes): use against capacity, and where hits were found")
    for column in ("tier", "held", "capacity", "use", "hits", "share of hits"):
        table.add_column(column, justify="left" if column == "tier" else "right")
    for tier, row in report["tiers"].items():
        table.add_row(tier, format_bytes(row["held_bytes"]), format_bytes(row["capacity_bytes"]),
                      f"{row['use']:.0%}", str(row["hits"]), f"{row['hit_share']:.0%}")
    return table


def _prefix_table(report: dict) -> Table | None:
    prefixes = report.get("top_prefixes") or []
    if not prefixes:
        return None
    table = Table(title="top prefixes (by recent lookups)")
    for column in ("prefix (last key)", "pages", "requests", "nodes"):
        table.add_column(column, justify="left" if column.startswith("prefix") else "right")
    for prefix in prefixes:
        table.add_row(prefix["key"][:16], str(prefix["pages"]), str(prefix["requests"]),
                      str(prefix["nodes"]))
    return table


def _quota_table(report: dict) -> Table:
    table = Table(title="models and namespaces: quotas (per tier per node) and use")
    for column in ("kind", "name", "min", "max", "weight", "priority", "held"):
        table.add_column(column, justify="left" if column in ("kind", "name") else "right")
    for kind in ("models", "namespaces"):
        for name, row in report["registry"][kind].items():
            maximum = "-" if row["max_bytes"] is None else format_bytes(row["max_bytes"])
            priority = row.get("priority", "normal") if kind == "namespaces" else "-"
            table.add_row(kind[:-1], name, format_bytes(row["min_bytes"]), maximum,
                          f"{row['weight']:g}", priority, format_bytes(row.get("held_bytes", 0)))
    return table
