"""Errors the public API raises by name, importable without Ray (the CLI catches them)."""

from __future__ import annotations


class ServiceNotRunning(RuntimeError):
    """raykv (its directory, controller or node actors) does not run on this Ray cluster."""
