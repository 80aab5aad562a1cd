"""Issue 30, item 8: a run whose output disk fills ends with the first error, located and resumable.

The workers' typed ``ShardIOError`` names the shard's file; a cleanup step on the same full disk (the run's
state file as it ends) must never replace it with a bare ``OSError: No space left on device``. The full
disk is simulated in this process (the shard writer's ``os.write`` and every atomic write under the run
folder fail with ``ENOSPC`` once the first record is written), and, as root, made real with a 1.6 MB
tmpfs for a ``gym-ray run`` subprocess, whose folder then resumes on a larger disk with the ledger clean.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray import cli
from gym_ray.record import atomic, writer
from gym_ray.record.ledger import check_run
from gym_ray.servers import calc_config, calc_rows, start_in_thread
from gym_ray.servers.launch import ThreadedDeployment
from tests.run._cli import cli_env, write_yaml

pytestmark = pytest.mark.timeout(120)

NO_SPACE = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def servers() -> Iterator[ThreadedDeployment]:
    with start_in_thread(calc_config(seed=3, latency_ms=0, latency_jitter_ms=0)) as deployment:
        yield deployment


class _Os:
    """The ``os`` module as one module sees it, with ``write`` / ``open`` failing under ``root`` once full."""

    def __init__(self, root: Path, full: list[bool], *, fill_on: str | None = None) -> None:
        self._root = str(root.resolve())
        self._full = full
        self._fill_on = fill_on

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def write(self, fd: int, data: Any) -> int:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if target.startswith(self._root) and (self._full[0] or target.endswith(self._fill_on or "\0")):
            self._full[0] = True
            raise NO_SPACE
        return os.write(fd, data)

    def open(self, path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if self._full[0] and os.path.abspath(path).startswith(self._root) and flags & os.O_CREAT:
            raise NO_SPACE
        return os.open(path, flags, *args, **kwargs)


def test_the_first_error_is_reported_with_its_file_and_the_word_resumable(
    tmp_path: Path,
    servers: ThreadedDeployment,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = write_yaml(tmp_path / "run.yaml", servers.config)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in calc_rows(4)))
    out = tmp_path / "out"
    full = [False]
    # The disk fills at the first record of the successes file; from then on nothing new can be written there.
    monkeypatch.setattr(writer, "os", _Os(out, full, fill_on="rollouts-00000.jsonl"))
    monkeypatch.setattr(atomic, "os", _Os(out, full))
    status = cli.main(
        [
            "run",
            str(config),
            f"+input_jsonl_fpath={rows}",
            f"+output_dir={out}",
            "--local",
            "--progress",
            "off",
        ]
    )
    err = capsys.readouterr().err.splitlines()
    assert status == 1
    assert full[0]
    assert err[-1] == (
        f"gym-ray run: ShardIOError: shard '00000': appending to {out}/rollouts-00000.jsonl failed: ENOSPC "
        "No space left on device. The shard is failed and takes no more writes; fsync is not retried. Fix "
        "the cause (free space, disk errors), then resume the shard with a new writer; the run folder "
        f"{out} is resumable: rerun the same command to run only what is missing"
    )
    assert not any(line.startswith("gym-ray run: OSError") for line in err), err


def _mounted_tmpfs(folder: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=False)
    return done.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_real_full_disk_then_a_resume_on_a_larger_one(tmp_path: Path, servers: ThreadedDeployment) -> None:
    disk = tmp_path / "disk"
    if not _mounted_tmpfs(disk, "1600k"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        config = write_yaml(tmp_path / "run.yaml", {**servers.config, "shard_size": 5000})
        rows = tmp_path / "rows.jsonl"
        padded = [
            {**row, "responses_create_params": {"input": f"What is {i} + 1? " + "x" * 200}}
            for i, row in enumerate(calc_rows(3000))
        ]
        # 1 MB of rows: the plan fits on the disk, the results do not
        rows.write_text("".join(json.dumps(row) + "\n" for row in padded))
        out = disk / "out"
        args = [sys.executable, "-m", "gym_ray.cli", "run", str(config), f"+input_jsonl_fpath={rows}"]
        args += [f"+output_dir={out}", "--local", "--progress", "off"]
        done = subprocess.run(args, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=90)
        last = done.stderr.splitlines()[-1]
        assert done.returncode == 1, done.stderr
        assert last.startswith(
            f"gym-ray run: ShardIOError: shard '00000': appending to {out}/rollouts-00000."
        ), last
        assert last.endswith(
            "failed: ENOSPC No space left on device. The shard is failed and takes no more writes; fsync is "
            "not retried. Fix the cause (free space, disk errors), then resume the shard with a new writer; "
            f"the run folder {out} is resumable: rerun the same command to run only what is missing"
        ), last
        moved = tmp_path / "larger"
        shutil.copytree(out, moved)
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    args[args.index(f"+output_dir={out}")] = f"+output_dir={moved}"
    again = subprocess.run(args, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=90)
    assert again.returncode == 0, again.stderr
    # The write that found the disk full may have left part of a line: the resume drops it, and says so.
    torn = (
        r"gym-ray run: warning: Dropped a torn tail \(\d+ bytes, 1 lines?\) from "
        rf"{re.escape(str(moved))}/\S+ before appending\."
    )
    assert all(re.fullmatch(torn, line) for line in again.stderr.splitlines()), again.stderr
    report = check_run(moved)
    assert (report.planned, report.lost, report.missing, report.duplicates, report.ok) == (
        3000,
        0,
        0,
        0,
        True,
    )
