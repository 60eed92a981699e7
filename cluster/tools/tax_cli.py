"""`raykv tax`: its settings and the command line (torch is imported only when it runs).

The measurement is in cluster/tools/tax.py; see there for what it does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from cluster.core.config import CacheConfig
from cluster.core.spec import ModelSpec
from cluster.core.tax_model import num_disk_pages


@dataclass(frozen=True, slots=True)
class TaxSettings:
    """What one `raykv tax` run decodes, and how long it measures."""

    model: str = "small-llama"
    context_tokens: int = 65536
    disk_fraction: float = 0.25
    page_tokens: int = 256
    disk_dir: str | None = None  # None: a temp dir beside raykv's default disk dir
    num_rounds: int = 15
    tokens_per_round: int = 1
    window_pages: int = 8
    query_heads_per_kv_head: int = 4  # as small-llama and Llama-3.1-8B have
    num_threads: int = CacheConfig().disk_threads
    fio_peer: bool = True

    def __post_init__(self) -> None:
        """ValueError for settings that cannot run, before any file is written."""
        ModelSpec.preset(self.model)
        for name in ("page_tokens", "num_rounds", "tokens_per_round", "window_pages",
                     "query_heads_per_kv_head", "num_threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        num_disk_pages(self.context_tokens // self.page_tokens, self.disk_fraction)


DEFAULT = TaxSettings()
QUICK = {"context_tokens": 16384, "num_rounds": 3, "tokens_per_round": 1, "fio_peer": False}


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
    rounds: Annotated[int, typer.Option(help="Rounds of every mode, interleaved.")] = (
        DEFAULT.num_rounds),
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the result here.")] = None,
    png: Annotated[Path | None, typer.Option(help="Write the chart here.")] = Path("out/tax.png"),
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
    for path in (json_path, png):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
    from cluster.tools.tax import run_tax

    run_tax(settings, str(json_path) if json_path else None, str(png) if png else None)

