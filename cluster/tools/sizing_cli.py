"""`raykv size`: the KV-cache sizing report as a rich table or JSON.

The lead's cluster/cli.py registers `size_command` on the `raykv` Typer app.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from cluster.core.sizing import format_bytes, parse_bytes, resolve_spec, size_report


def size_command(
    model: Annotated[
        str,
        typer.Option(
            help="Preset model (see cluster.core.spec.PRESETS), or a new name when --layers, "
            "--kv-heads and --head-dim are all given. Overriding a preset's geometry "
            'names the model "custom".'
        ),
    ] = "llama-3.1-8b",
    context: Annotated[int, typer.Option(help="Context length per sequence, in tokens.")] = 131072,
    vram: Annotated[str, typer.Option(help="KV budget, e.g. 80GiB, 40GB, 512MiB.")] = "80GiB",
    dtype: Annotated[
        str | None, typer.Option(help="KV dtype (default: the model's), e.g. bf16, fp16, fp32.")
    ] = None,
    page_tokens: Annotated[int, typer.Option(help="Tokens per cache page.")] = 256,
    layers: Annotated[int | None, typer.Option(help="Number of layers (custom model).")] = None,
    kv_heads: Annotated[int | None, typer.Option(help="Number of KV heads (custom model).")] = None,
    head_dim: Annotated[int | None, typer.Option(help="Head dimension (custom model).")] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print JSON instead of a table.")
    ] = False,
) -> None:
    """How many sequences of a context fit in a VRAM budget, natively and quantized."""
    try:
        spec = resolve_spec(model, dtype, layers, kv_heads, head_dim)
        report = size_report(spec, context, parse_bytes(vram), page_tokens)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        Console().print(report_table(report))


def report_table(report: dict) -> Table:
    """One row per storage format."""
    model = report["model"]
    title = (
        f"{model['name']}: {model['num_layers']} layers x {model['num_kv_heads']} KV heads x "
        f"{model['head_dim']} dims, {report['context_tokens']:,} tokens "
        f"({report['pages_per_sequence']:,} pages of {report['page_tokens']}) "
        f"in {format_bytes(report['vram_bytes'])}"
    )
    table = Table(title=title)
    for header in ("storage", "per token", "per page", "per sequence", "sequences", "vs model"):
        table.add_column(header, justify="left" if header == "storage" else "right")
    for row in report["storage"].values():
        table.add_row(
            row["storage"] + (" (+scales)" if row["quantized"] else ""),
            format_bytes(row["bytes_per_token"]),
            format_bytes(row["page_bytes"]),
            format_bytes(row["bytes_per_sequence"]),
            f"{row['sequences_fit']:,}",
            f"{row['ratio_vs_model_dtype']:.3f}x",
        )
    return table
