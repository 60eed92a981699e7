"""`raykv tax`: the command line (torch is imported only when it runs).

The settings are in cluster/tools/tax_report.py, the measurement in cluster/tools/tax.py (see
there for what it does); this module imports the measurement only when the command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cluster.tools.outputs import checked_output, make_parents
from cluster.tools.tax_report import DEFAULT, TaxSettings


def tax_command(
    model: Annotated[str, typer.Option(help="Model preset whose KV geometry is decoded "
                                            "(see `raykv size`).")] = DEFAULT.model,
    context_tokens: Annotated[int, typer.Option(help="Context length in tokens (full pages "
                                                     "only).")] = DEFAULT.context_tokens,
    disk_fraction: Annotated[float, typer.Option(help="Fraction of the context's pages that "
                                                      "live on disk.")] = DEFAULT.disk_fraction,
    page_tokens: Annotated[int, typer.Option(help="Tokens per page.")] = DEFAULT.page_tokens,
    disk_dir: Annotated[Path | None, typer.Option(help="Directory on a real disk (not tmpfs) "
                        "for the slab files; default: beside raykv's disk dir. A temp dir "
                        "inside it is removed at the end.")] = None,
    rounds: Annotated[int, typer.Option(help="Rounds of every mode, interleaved (at least 3).")] = (
        DEFAULT.num_rounds),
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="Write the result here (its folder is made).",
        callback=checked_output)] = None,
    png: Annotated[Path | None, typer.Option(help="Write the chart here (its folder is made).",
                                             callback=checked_output)] = Path("out/tax.png"),
    fio: Annotated[bool, typer.Option(help="Also measure fio's O_DIRECT read bandwidth as a "
                                           "peer (~4 s).")] = DEFAULT.fio_peer,
) -> None:
    """Measure the per-token latency tax of KV pages on disk against its model, without and
    with prefetch and with fp8 and int8 pages; print a table, write a PNG and JSON."""
    try:
        settings = TaxSettings(model=model, context_tokens=context_tokens,
                               disk_fraction=disk_fraction, page_tokens=page_tokens,
                               disk_dir=str(disk_dir) if disk_dir else None, num_rounds=rounds,
                               fio_peer=fio)
    except ValueError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from error
    make_parents(json_path, png)
    from cluster.tools.tax import run_tax

    run_tax(settings, str(json_path) if json_path else None, str(png) if png else None)

