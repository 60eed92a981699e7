"""Where the commands write their results: checked before any work, written whole or not at all.

    checked_output   a typer callback for an output path option (--json, --plot, --png): a
                     directory, a path under a file or a folder that takes no new file is a
                     one-line error (exit 2), so a long run never ends by losing its result
                     to a bad path
    make_parents     the missing folders of checked paths, made when the command's other
                     checks passed and its work starts (a refused command makes nothing)
    write_text_atomic  the text to a temporary file in the same folder, then os.replace: a
                     reader sees the previous file or the new one, never half of either
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import typer


def output_path_problem(path: Path) -> str | None:
    """Why a file cannot be written at `path` (None when it can): a directory there, a file
    where one of its folders should be, or a folder that takes no new file. Makes nothing."""
    if path.is_dir():
        return f"{path} is a directory"
    folder = path.parent
    while not folder.exists() and folder != folder.parent:  # the folder to make it in
        folder = folder.parent
    if not folder.is_dir():
        return f"cannot make {path.parent}: {folder} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=folder):  # the folder takes a new file
            pass
    except OSError as error:
        return f"cannot write in {folder}: {error.strerror or error}"
    if path.exists() and not os.access(path, os.W_OK):
        return f"{path} is not writable"
    return None


def checked_output(ctx: typer.Context, param: typer.CallbackParam,
                   path: Path | None) -> Path | None:
    """An output option's callback: `path` if a file can be written there, else
    typer.BadParameter before the command starts its work. Makes nothing (make_parents does,
    once the command's other checks passed)."""
    if path is None or ctx.resilient_parsing:
        return path
    problem = output_path_problem(path)
    if problem:
        raise typer.BadParameter(problem, ctx=ctx, param=param)
    return path


def make_parents(*paths: Path | None) -> None:
    """Make each path's missing parent folders (None: no path), before the work that writes
    there: a fresh checkout has no out/."""
    for path in paths:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` whole: a temporary file beside it, then os.replace."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, temp_path = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.",
                                     suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temp_path, _mode_for(path))
        os.replace(temp_path, path)
    except BaseException:
        os.unlink(temp_path)
        raise


def _mode_for(path: str | os.PathLike) -> int:
    """The file's mode now, or rw-r--r-- for a new one (mkstemp's own is rw-------)."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        return 0o644
