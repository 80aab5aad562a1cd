"""What a control actor must remember across a restart of its process: an append-only JSON-lines file in
the run folder (``.control/<call>/<role>.jsonl``), one line per decision, written and fsynced before the
decision is acted on or answered.

Ray restarts a dead control actor (``max_restarts``) by running its constructor again with the same
arguments; the constructor replays its journal and so starts where the dead process stopped. Calls the dead
process never answered are sent again by Ray (``max_task_retries``), and each decision is made so that a
second delivery of the same call gives the same answer (see :class:`~gym_ray.distributed.driver.ShardDriver`
and :class:`~gym_ray.distributed.coordinator.RunCoordinator`).

Every run call (each ``gym-ray run`` or ``collect()``) has a folder of its own, so a later call on the same
run folder (a resume) never reads an earlier call's decisions; the folder is removed when the call ends.
A line cut short by the process's death (the last one, without its newline) was never acted on and is
ignored.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

__all__ = ["CONTROL_DIR", "ControlJournal", "call_folder", "remove_call_folder"]

#: Folder of the run folder holding each run call's control journals.
CONTROL_DIR = ".control"


def call_folder(run_dir: str | os.PathLike[str]) -> str:
    """A new folder name for one run call's journals (nothing is created yet)."""
    return str(Path(run_dir) / CONTROL_DIR / uuid.uuid4().hex[:12])


def remove_call_folder(folder: str) -> None:
    """Remove one call's journals, and ``.control`` when no other call's are left (best effort)."""
    shutil.rmtree(folder, ignore_errors=True)
    try:
        os.rmdir(Path(folder).parent)
    except OSError:
        pass  # another call's folder is still there, or it is gone already


class ControlJournal:
    """One control actor's journal.

    Args:
        path: The journal file; its folder is created on the first :meth:`append`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._checked_tail = False

    def entries(self) -> list[dict[str, Any]]:
        """Every whole line written so far, in order (none when the file does not exist)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        whole, _, _torn = data.rpartition(b"\n")
        return [json.loads(line) for line in whole.split(b"\n") if line]

    def append(self, entry: dict[str, Any]) -> None:
        """Write one line and fsync it: once this returns, a restarted process replays it."""
        if not self._checked_tail:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._cut_torn_tail()
            self._checked_tail = True
        with open(self.path, "ab") as handle:
            handle.write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")
            handle.flush()
            os.fsync(handle.fileno())

    def _cut_torn_tail(self) -> None:
        """Drop a last line the previous process left without its newline (so appends start a line)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        if data and not data.endswith(b"\n"):
            os.truncate(self.path, data.rfind(b"\n") + 1)
