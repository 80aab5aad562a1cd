"""A planner killed mid-plan leaves its dedupe folder; the next planner on the host removes it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from gym_ray.plan._spill_dedupe import SpillDedupe, reclaim_stale_folders


def _dead_pid() -> int:
    """The pid of a process that has exited (and, checked, is not running again)."""
    for _ in range(5):
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        try:
            os.kill(child.pid, 0)
        except ProcessLookupError:
            return child.pid
    raise AssertionError("every exited child's pid was reused at once")


def test_the_folder_of_a_killed_planner_is_removed_and_no_other(tmp_path: Path) -> None:
    host = socket.gethostname()
    dead = _dead_pid()
    stale = tmp_path / f"gym_ray-dedupe-{dead}@{host}-abc123_x"
    live = tmp_path / f"gym_ray-dedupe-{os.getpid()}@{host}-def456"
    elsewhere = tmp_path / f"gym_ray-dedupe-{dead}@not-{host}-ghi789"  # another host's (shared TMPDIR)
    unowned = tmp_path / "gym_ray-dedupe-jkl012"  # no owner in the name (an older gym_ray)
    other = tmp_path / f"something-{dead}@{host}-else"
    for folder in (stale, live, elsewhere, unowned, other):
        folder.mkdir()
        (folder / "digests-000000.bin").write_bytes(b"\0" * 16)

    with SpillDedupe(folder=str(tmp_path)) as dedupe:
        assert dedupe.folder.name.startswith(f"gym_ray-dedupe-{os.getpid()}@{host}-")
        left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(p.name for p in (live, elsewhere, unowned, other, dedupe.folder))
    assert not dedupe.folder.exists()  # its own folder goes on close, as before
    assert reclaim_stale_folders(tmp_path) == []  # nothing stale is left to remove


def test_a_planner_killed_while_planning_leaves_a_folder_the_next_one_removes(tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        "from gym_ray.plan._spill_dedupe import SpillDedupe\n"
        f"d = SpillDedupe(folder={str(tmp_path)!r})\n"
        "print(d.folder, flush=True)\n"
        "os._exit(9)  # as if killed: no close, no cleanup\n"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert child.returncode == 9, child.stderr
    left = Path(child.stdout.strip())
    assert left.is_dir()
    assert reclaim_stale_folders(tmp_path) == [left]
    assert not left.exists()
