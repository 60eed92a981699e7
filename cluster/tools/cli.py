"""The `raykv` command: sizing, the paging tax, benchmarks and the demo."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Annotated

import typer

from cluster.tools.bench.harness import failed
from cluster.tools.operator_cli import pin_command, unpin_command, warm_command
from cluster.tools.ops_cli import service_errors, start_command, status_command, stop_command
from cluster.tools.outputs import checked_output, make_parents
from cluster.tools.quota_cli import quota_app
from cluster.tools.serve_cli import serve_command
from cluster.tools.sizing_cli import size_command
from cluster.tools.tax_cli import tax_command

app = typer.Typer(help="raykv: a Ray-distributed, tiered KV-cache service for LLM serving.",
                  no_args_is_help=True, add_completion=False)
bench_app = typer.Typer(help="Benchmarks: raykv side by side with the machine's limits and "
                             "peers, written as JSON with a top-level \"ratios\" object.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(quota_app, name="quota")
app.command("size", help="KV bytes per token and sequence, and how many sequences fit.")(
    size_command)
app.command("serve")(serve_command)
app.command("start")(service_errors(start_command))
app.command("stop")(service_errors(stop_command))
app.command("status")(service_errors(status_command))
app.command("pin")(service_errors(pin_command))
app.command("unpin")(service_errors(unpin_command))
app.command("warm")(service_errors(warm_command))
app.command("tax", help="The per-token latency tax of KV pages on disk, measured against "
                        "pages x (latency + bytes / bandwidth), without and with prefetch, with "
                        "fp8 and int8 pages.")(tax_command)

# name -> module with `run(json_path: str | None, quick: bool) -> dict`
BENCHMARKS = {
    "tiers": "cluster.tools.bench.tiers",
    "pages": "cluster.tools.bench.pages",
    "hashing": "cluster.tools.bench.hashing",
    "directory": "cluster.tools.bench.directory",
    "remote": "cluster.tools.bench.remote",
    "ttft": "cluster.tools.bench.ttft",
    "serve": "cluster.tools.bench.serve",
    "elastic": "cluster.tools.bench.elastic",
    "tax": "cluster.tools.tax",
    "vllm": "cluster.tools.bench.vllm",
    "vllm-serve": "cluster.tools.bench.vllm_serve",
    "burst": "cluster.tools.bench.burst",
    "faults": "cluster.tools.bench.faults",
    "trace": "cluster.tools.bench.trace",
}

# Output paths are checked before any work, their folders made as it starts (outputs.py).
JsonPath = Annotated[Path | None, typer.Option(
    "--json", help="write results here as JSON (its folder is made)", callback=checked_output)]
Quick = Annotated[bool, typer.Option("--quick", help="smaller sizes, for a smoke run")]
PlotPath = Annotated[Path | None, typer.Option(
    "--plot", help="write a chart here (PNG; its folder is made)", callback=checked_output)]
TracePath = Annotated[Path, typer.Option(
    exists=True, dir_okay=False, help="a block trace in Mooncake's JSONL format")]


def _bench(name: str, json_path: Path | None, quick: bool, **extra) -> None:
    make_parents(json_path)
    module = importlib.import_module(BENCHMARKS[name])
    result = module.run(str(json_path) if json_path else None, quick, **extra)
    typer.echo(json.dumps(result["ratios"], indent=2))
    not_exercised = failed(result)
    if not_exercised:  # a ratio that nothing exercised fails the run rather than passing
        for name, why in not_exercised.items():
            typer.echo(f"FAILED {name}: not exercised: {why}", err=True)
        raise typer.Exit(2)


def _register(name: str, help_text: str) -> None:
    def command(json_path: JsonPath = None, quick: Quick = False) -> None:
        _bench(name, json_path, quick)

    bench_app.command(name, help=help_text)(command)


def _register_plotted(name: str, help_text: str) -> None:
    def command(json_path: JsonPath = None, quick: Quick = False, plot: PlotPath = None) -> None:
        make_parents(plot)
        _bench(name, json_path, quick, plot_path=str(plot) if plot else None)

    bench_app.command(name, help=help_text)(command)


_register("tiers", "Host/disk get and put vs memcpy, fio, Redis and Ray's object store.")
_register("pages", "Get and put latency per page (16-, 64-, 256-token pages, 256 to 32,768 "
                   "tokens) vs a memcpy of the same bytes and a no-op call.")
_register("hashing", "Page-key hashing cost in ns per token.")
_register("directory", "Longest-prefix lookup latency vs a no-op RPC and Redis EXISTS.")
_register("remote", "Cross-node get throughput vs a raw Ray object transfer.")
_register("ttft", "Time to first token from the host and disk tiers vs recompute and ideal.")
_register("elastic", "Three models in one budget: elastic sharing vs a static split, idle "
                     "shrink time, min-quota violations.")
_register_plotted("serve", "One chat trace through the Serve app with raykv's, Serve's pow2 and "
                           "Ray Serve LLM's prefix router: TTFT, cached tokens, replica shares.")
_register("tax", "The paging tax (`raykv tax` with its defaults; a PNG beside the JSON).")
_register("vllm", "vLLM TTFT with RaykvConnector vs LMCache's and no connector (run from "
          ".venv-vllm; `make bench-vllm`).")
_register("faults", "Faults under load on 3 simulated nodes (nodes, actors, directory, Redis, "
                   "clients, replicas, damaged, full and slow disks, lost event batches), "
                   "the fuzzers, a soak: wrong bytes, client errors, recovery seconds.")
_register_plotted("burst", "A spiky multi-model trace on 3 simulated nodes, rebalancing on and "
                           "off: p99 fetch latency, hit ratio, memory per model over time.")



@bench_app.command("vllm-serve")
def vllm_serve_command(
    json_path: JsonPath = None,
    quick: Quick = False,
    setups: Annotated[str | None, typer.Option(
        help="comma-separated set-ups to replay (of raykv, kv-aware, prefix, pow2; default: "
             "all, pow2 left out of a quick run; run only when named: raykv-direct, "
             "raykv-async, raykv-save-async, kv-aware-raykv, raykv-rerender)")] = None,
    parts: Annotated[str, typer.Option(
        help="comma-separated parts: main (the trace's set-ups), recompute (the router's "
             "fetch-or-recompute choices under a slowed disk, both run)")] = "main,recompute",
) -> None:
    """Ray Serve LLM on vLLM's CPU build, 3 replicas, Mooncake's conversation trace: raykv
    (connector + router) vs Ray's KVAwareRouter, PrefixCacheAffinityRouter and pow2 (run from
    .venv-vllm; `make bench-vllm-serve`)."""
    _bench("vllm-serve", json_path, quick,
           setups=tuple(setups.split(",")) if setups else None,
           parts=tuple(parts.split(",")))


@bench_app.command("trace")
def trace_command(
    json_path: JsonPath = None,
    quick: Quick = False,
    trace: Annotated[Path | None, typer.Option(
        exists=True, dir_okay=False,
        help="a block trace in Mooncake's JSONL format (default: "
             "../shared/traces/mooncake_conversation.jsonl)")] = None,
) -> None:
    """The live check of `raykv sim`: a trace's first requests, scaled to the CPU model and
    time-compressed, over HTTP on 3 simulated nodes (raykv against local caches), then the
    simulator on the same configuration: how far its hit ratio is from the live one."""
    _bench("trace", json_path, quick, trace_path=str(trace) if trace else None)


@bench_app.command("summary")
def summary_command(
    bench_dir: Annotated[Path, typer.Argument(
        help="folder of benchmark JSON files (the default is relative: run from the "
             "repository root)")] = Path("docs/bench"),
    doc: Annotated[Path | None, typer.Option(help="rewrite this file's summary block")] = None,
) -> None:
    """The summary table of every JSON result in BENCH_DIR, as markdown (with --doc, written
    into that file's summary block instead)."""
    from cluster.tools.bench import summary

    try:
        if doc is None:
            typer.echo(summary.table(bench_dir))
            return
        changed = summary.rewrite(doc, bench_dir)
    except summary.SummaryError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{doc}: summary {'rewritten' if changed else 'already current'}")


@app.command("sim")
def sim_command(
    trace: TracePath,
    json_path: JsonPath = None,
    plot: PlotPath = None,
    part: Annotated[list[str] | None, typer.Option(
        help="what to simulate: eviction, routing, scale, fig10 (repeat it; all by default)"
    )] = None,
    limit: Annotated[int | None, typer.Option(
        min=1, help="only the trace's first LIMIT requests (at least 1)")] = None,
    window_s: Annotated[float | None, typer.Option(
        help="the scale part: only the first WINDOW_S seconds of the replicated trace")] = None,
    start_s: Annotated[float | None, typer.Option(
        help="only the requests from START_S seconds on (a held-out part), started cold")] = None,
) -> None:
    """Replay a block trace offline through raykv's own policies. eviction: one global
    cache of 1k..50k blocks under every eviction policy raykv ships and Belady's bound.
    routing: 16 simulated H100 nodes, raykv's router and shared tiers against the baselines'
    routers. scale: 4..1024 nodes at a constant load per node. fig10: Mooncake's Fig. 10
    setting, 10 nodes x 3M tokens, local caches against raykv's global cache."""
    from cluster.core.trace_format import TraceError
    from cluster.tools import sim

    unknown = sorted(set(part or ()) - set(sim.PARTS))
    if unknown:
        raise typer.BadParameter(f"unknown part(s) {unknown}; this version has {list(sim.PARTS)}",
                                 param_hint="--part")
    make_parents(json_path, plot)
    try:
        result = sim.run(str(trace), str(json_path) if json_path else None,
                         str(plot) if plot else None, tuple(part or sim.PARTS),
                         sim.Bounds(limit, window_s, start_s))
    except TraceError as error:  # raised while the trace is read, before any simulation
        raise typer.BadParameter(str(error), param_hint="--trace") from None
    typer.echo(json.dumps(result["ratios"], indent=2))
    for name, why in failed(result).items():
        typer.echo(f"FAILED {name}: not exercised: {why}", err=True)
    if failed(result):
        raise typer.Exit(2)


@app.command("demo")
def demo_command(
    png: Annotated[Path, typer.Option(help="where to write the chart (its folder is made)",
                                      callback=checked_output)] = Path("out/demo.png"),
    num_nodes: Annotated[int, typer.Option(help="simulated Ray nodes")] = 3,
) -> None:
    """The Serve app on raykv on a simulated cluster under a multi-tenant chat workload:
    cached tokens, hits by tier, TTFT with the cache against a recompute; a table and a PNG."""
    from cluster.tools.demo import run_demo

    make_parents(png)
    run_demo(png, num_nodes)


if __name__ == "__main__":
    app()
