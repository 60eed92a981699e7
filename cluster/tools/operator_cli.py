"""`raykv pin`, `raykv unpin` and `raykv warm`: the operator API on the running service.

A prompt is given as text (keyed as the Serve app keys a completion's prompt: its byte-level
tokenizer, BOS first), as a chat's system message (the prefix every chat that opens with it
shares), or as a JSON file of token ids (any tokenizer's: a vLLM engine's, say).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

Model = Annotated[str, typer.Option(help="the model preset the pages belong to (see `raykv "
                                         "size --help`)")]
Namespace = Annotated[str, typer.Option(help="the namespace (tenant) of the pages")]
Text = Annotated[str | None, typer.Option(help="the prompt's text, tokenized as the Serve app "
                                               "tokenizes a completion's prompt")]
System = Annotated[str | None, typer.Option(
    help="a chat's system message: the prefix every chat opening with it shares")]
TokensFile = Annotated[Path | None, typer.Option(help="a JSON list of the prompt's token ids")]
Address = Annotated[str | None, typer.Option(help="Ray cluster address (default: RAY_ADDRESS, "
                                                  "else the local cluster)")]


def prompt_tokens(text: str | None, system: str | None, tokens_file: Path | None) -> list[int]:
    """The prompt's token ids from exactly one of the three ways of giving it."""
    from cluster.serving import tokenizer

    given = [v for v in (text, system, tokens_file) if v is not None]
    if len(given) != 1:
        raise typer.BadParameter("give the prompt one way: --text, --system or --tokens-file")
    if text is not None:
        return tokenizer.encode(text)
    if system is not None:
        header = tokenizer.ROLE_HEADER.format(role="system")
        return tokenizer.encode(header + system + tokenizer.TURN_END)
    try:
        tokens = json.loads(tokens_file.read_text())
    except (OSError, ValueError) as error:
        raise typer.BadParameter(f"{tokens_file}: {error}", param_hint="--tokens-file") from None
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise typer.BadParameter(f"{tokens_file} must hold a JSON list of token ids",
                                 param_hint="--tokens-file")
    return tokens


def _client(model: str, namespace: str, address: str | None):
    from cluster import ModelSpec, connect

    try:
        spec = ModelSpec.preset(model)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--model") from None
    if address:
        os.environ["RAY_ADDRESS"] = address
    try:
        return connect(spec, namespace)
    except ValueError as error:  # an unknown namespace
        raise typer.BadParameter(str(error), param_hint="--namespace") from None


def _refused(error: Exception) -> typer.Exit:
    Console(stderr=True).print(f"[red]refused:[/] {error}")
    return typer.Exit(1)


def pin_command(
    ttl: Annotated[float, typer.Option("--ttl", help="seconds the pin lives")] = 600.0,
    text: Text = None, system: System = None, tokens_file: TokensFile = None,
    model: Model = "small-llama", namespace: Namespace = "default", address: Address = None,
) -> None:
    """Keep a prompt's stored pages on every node that holds them for --ttl seconds:
    eviction passes them by. Pinning it again restarts the TTL; past a node's cap
    (max_pinned_fraction of its memory) the pin is refused and nothing is pinned."""
    tokens = prompt_tokens(text, system, tokens_file)
    client = _client(model, namespace, address)
    try:
        pages = client.pin(tokens, ttl_s=ttl)
    except (ValueError, RuntimeError) as error:
        raise _refused(error) from None
    total = len(tokens) // client.page_tokens
    Console().print(f"pinned {pages} of the prompt's {total} pages "
                    f"({pages * client.page_tokens} tokens) for {ttl:g} s")


def unpin_command(
    text: Text = None, system: System = None, tokens_file: TokensFile = None,
    model: Model = "small-llama", namespace: Namespace = "default", address: Address = None,
) -> None:
    """End a prompt's pin now, on every node."""
    tokens = prompt_tokens(text, system, tokens_file)
    client = _client(model, namespace, address)
    try:
        pages = client.unpin(tokens)
    except (ValueError, RuntimeError) as error:
        raise _refused(error) from None
    Console().print(f"unpinned {pages} pages")


def warm_command(
    node: Annotated[str, typer.Option(help="the node to warm: its id, or a unique prefix of "
                                           "it (as `raykv status` shows)")],
    text: Text = None, system: System = None, tokens_file: TokensFile = None,
    model: Model = "small-llama", namespace: Namespace = "default", address: Address = None,
) -> None:
    """Copy a prompt's stored pages onto a node ahead of its traffic (the pages it lacks
    are pulled from their holders, as the control loop replicates hot prefixes)."""
    tokens = prompt_tokens(text, system, tokens_file)
    client = _client(model, namespace, address)
    try:
        pages = client.warm(tokens, node)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--node") from None
    except RuntimeError as error:
        raise _refused(error) from None
    total = len(tokens) // client.page_tokens
    Console().print(f"{pages} of the prompt's {total} pages are on node {node}")
