"""The run folder's note of a server outage that stopped the run (``server_outage.json``).

A run stopped by :class:`~gym_ray.errors.ServerOutageError` writes this note (atomically) before the
error leaves the run, so that ``gym-ray status`` can say why the run is unfinished and what to do; the
next run on the folder that completes removes it. It names the server and its URL, never a config value.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from gym_ray.errors import ServerOutageError
from gym_ray.record.atomic import atomic_write_bytes

__all__ = ["OUTAGE_FILE", "clear_outage", "read_outage", "write_outage"]

#: The note's file name inside a run folder.
OUTAGE_FILE = "server_outage.json"


def write_outage(run_dir: str | os.PathLike[str], exc: ServerOutageError) -> None:
    """Record that ``exc`` stopped the run in ``run_dir`` (best effort: a failed write is not raised)."""
    note = {"server": exc.server, "url": exc.url, "down_s": round(exc.down_s, 1), "stopped_at": time.time()}
    try:
        atomic_write_bytes(Path(run_dir) / OUTAGE_FILE, (json.dumps(note) + "\n").encode())
    except OSError:
        pass  # the error itself still reaches the caller; the note only helps `status`


def read_outage(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The note, or None when the folder has none (or an unreadable one)."""
    try:
        note = json.loads((Path(run_dir) / OUTAGE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) else None


def clear_outage(run_dir: str | os.PathLike[str]) -> None:
    """Remove the note (after a run on the folder completed)."""
    (Path(run_dir) / OUTAGE_FILE).unlink(missing_ok=True)
