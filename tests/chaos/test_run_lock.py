"""R17: a second run on a folder in use is refused before it plans or sends anything, naming the holder;
the lock dies with its holder's process (SIGKILL included)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gym_ray.distributed.api import acollect
from gym_ray.errors import RunLockError
from gym_ray.record.ledger import check_run
from gym_ray.record.run_lock import RUN_LOCK_FILE, RunLock
from gym_ray.run.collect import acollect_local
from gym_ray.servers import serve_config
from gym_ray.streaming.stream import RolloutStream
from tests.chaos.test_server_outage import _config, _rows, _until, print_figures


async def test_a_second_run_on_a_busy_folder_is_refused_before_it_plans_or_sends(tmp_path: Path) -> None:
    out = tmp_path / "run"
    async with serve_config(_config(latency_ms=20)) as dep:
        first = asyncio.create_task(
            acollect_local(dep.config, rows=_rows(120), output_dir=str(out), max_resident_tasks=8)
        )
        try:
            await _until(lambda: dep.stats("calc_env").requests >= 10, "the first run to send")
            requests_before = dep.stats("calc_env").requests
            with pytest.raises(RunLockError) as refused:
                await acollect_local(dep.config, rows=_rows(120), output_dir=str(out), max_resident_tasks=8)
            message = str(refused.value)
            assert f"collect pid {os.getpid()} on host {socket.gethostname()}, started 20" in message
            assert message.startswith(f"the run folder {out} is in use by another run")
            result = await first
        finally:
            first.cancel()
        requests = dep.stats("calc_env").requests
        print_figures("R17 second run refused", requests=requests, planned=120, before=requests_before)
        assert requests == 120  # every /run exactly once
        assert (result.succeeded, result.failed) == (120, 0)
        assert check_run(out).ok


async def test_collect_on_ray_and_a_recording_stream_are_refused_on_a_locked_folder(tmp_path: Path) -> None:
    out = tmp_path / "run"
    async with serve_config(_config(latency_ms=0)) as dep:
        with RunLock(out, what="collect"):
            with pytest.raises(RunLockError, match=rf"in use by another run \(collect pid {os.getpid()} "):
                await acollect(dep.config, rows=_rows(4), output_dir=str(out), num_workers=1)
            rows = iter(_rows(4))
            stream = RolloutStream(rows, config=dep.config, num_workers=1, record_dir=out)
            with pytest.raises(RunLockError, match=r"in use by another run \(collect pid "):
                await stream.start()
            assert next(rows)["expected_answer"] == "1"  # not one row was pulled
            assert sorted(p.name for p in out.iterdir()) == [RUN_LOCK_FILE]  # nothing planned
        assert not out.exists()  # the lock made the folder and nothing else used it: no trace left


def test_the_lock_is_released_by_the_kernel_when_its_holder_is_killed(tmp_path: Path) -> None:
    code = (
        "import sys, time\n"
        "from gym_ray.record.run_lock import RunLock\n"
        f"RunLock({str(tmp_path)!r}, what='collect').acquire()\n"
        "print('locked', flush=True)\n"
        "time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockError, match=rf"collect pid {holder.pid} on host "):
            RunLock(tmp_path).acquire()
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    with RunLock(tmp_path) as lock:
        assert lock.held
    assert (tmp_path / RUN_LOCK_FILE).exists()  # never unlinked
