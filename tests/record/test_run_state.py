"""The run folder's state file (gym_ray.record.run_state) as holding_run_folder writes it, and as status
reads it together with a probe of the run lock (gym_ray.record.run_lock): running / stopped (how) /
finished, killed when the lock is free but the file still says running, and nothing left behind by a run
that planned nothing."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import socket
import threading
from pathlib import Path

import pytest

from gym_ray.errors import (
    IncompleteRunError,
    InputError,
    ResumeError,
    RunLockError,
    RunTerminated,
    ServerOutageError,
    ShardIOError,
)
from gym_ray.record.run_lock import (
    RUN_LOCK_FILE,
    RunLock,
    describe_holder,
    holding_run_folder,
    lock_holder,
    refuse_if_held,
)
from gym_ray.record.run_state import (
    RUN_STATE_FILE,
    RunState,
    note_stop_signal,
    observe_state,
    read_state,
)

RECORD = b'{"format_version": 2}\n'


def _planned(run_dir: Path) -> None:
    (run_dir / "run_manifest.json").write_text('{"run_id": "r1"}\n')


def _end_with(run_dir: Path, exc: BaseException | None) -> RunState:
    """Hold the folder as a run that planned, leave the block with ``exc``, return the state written."""
    with pytest.raises(type(exc)) if exc is not None else contextlib.nullcontext():
        with holding_run_folder(run_dir, what="collect", record=RECORD) as folder:
            _planned(run_dir)
            running = read_state(run_dir)
            assert running is not None
            assert (running.state, running.pid) == ("running", os.getpid())
            assert running.host == socket.gethostname()
            assert (run_dir / "gym_ray_run.json").read_bytes() == RECORD
            if exc is None:
                folder.finish(True)
            else:
                raise exc
    state = read_state(run_dir)
    assert state is not None
    assert state.started_at == running.started_at
    assert state.ended_at is not None
    assert state.ended_at >= state.started_at
    return state


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        pytest.param(None, ("finished", None, None, True), id="complete"),
        pytest.param(
            IncompleteRunError("run folder x is incomplete"), ("finished", None, None, False), id="incomplete"
        ),
        pytest.param(RunTerminated("SIGTERM"), ("stopped", "sigterm", None, None), id="sigterm"),
        pytest.param(KeyboardInterrupt(), ("stopped", "ctrl-c", None, None), id="ctrl-c"),
        pytest.param(asyncio.CancelledError(), ("stopped", "cancelled", None, None), id="cancelled"),
        pytest.param(
            ServerOutageError("down", url="http://127.0.0.1:9", server="calc_env", down_s=300.4),
            (
                "stopped",
                "server-outage",
                "environment server 'calc_env' (http://127.0.0.1:9) was down for 300 s",
                None,
            ),
            id="outage",
        ),
        pytest.param(
            ShardIOError("shard 00003: No space left on device\nsecond line"),
            ("stopped", "error", "ShardIOError: shard 00003: No space left on device", None),
            id="error",
        ),
    ],
)
def test_the_state_a_run_leaves_says_how_it_ended(
    tmp_path: Path, exc: BaseException | None, expected: tuple[str, str | None, str | None, bool | None]
) -> None:
    state = _end_with(tmp_path / "run", exc)
    assert (state.state, state.stopped_by, state.detail, state.complete) == expected
    observed = observe_state(tmp_path / "run", lock_holder(tmp_path / "run"))
    assert (observed.state, observed.stopped_by, observed.complete) == (expected[0], expected[1], expected[3])
    assert observed.at == state.ended_at


@pytest.mark.parametrize(("signal_name", "cause"), [("SIGTERM", "sigterm"), ("SIGINT", "ctrl-c")])
def test_a_cancellation_by_a_noted_signal_records_the_signal(
    tmp_path: Path, signal_name: str, cause: str
) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(asyncio.CancelledError):
        _cancelled_after(run_dir, signal_name)
    note_stop_signal(None)
    state = read_state(run_dir)
    assert state is not None
    assert (state.state, state.stopped_by) == ("stopped", cause)


def _cancelled_after(run_dir: Path, signal_name: str) -> None:
    with holding_run_folder(run_dir, what="collect"):
        _planned(run_dir)
        note_stop_signal(signal_name)  # what run_until_signal's handlers do before cancelling the run
        raise asyncio.CancelledError


def test_a_killed_run_is_told_by_a_free_lock_and_a_state_that_still_says_running(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with holding_run_folder(run_dir, what="collect", record=RECORD):
        _planned(run_dir)
        live = observe_state(run_dir, lock_holder(run_dir))
        running_file = (run_dir / RUN_STATE_FILE).read_bytes()
    assert live.state == "running"
    assert live.holder is None  # the caller gives the holder's text (status: describe_holder)
    # as a SIGKILLed run leaves it: the kernel released the lock, the file still says running
    (run_dir / RUN_STATE_FILE).write_bytes(running_file)
    observed = observe_state(run_dir, lock_holder(run_dir))
    assert (observed.state, observed.stopped_by, observed.at) == ("stopped", "killed", None)
    assert observed.detail == (
        "the run's process ended without recording how (SIGKILL, the out-of-memory killer, or its node lost)"
    )


def test_a_folder_held_by_an_aggregate_keeps_the_state_its_run_left(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _end_with(run_dir, None)
    with RunLock(run_dir, what="aggregate"):
        holder = lock_holder(run_dir)
        assert holder is not None
        observed = observe_state(run_dir, holder, holder_text=describe_holder(holder))
    assert (observed.state, observed.complete) == ("finished", True)
    assert observed.holder is not None
    assert observed.holder.startswith(f"aggregate pid {os.getpid()} on host {socket.gethostname()}, started ")


def test_no_state_and_a_free_lock_is_unknown(tmp_path: Path) -> None:
    observed = observe_state(tmp_path, lock_holder(tmp_path))
    assert (observed.state, observed.stopped_by, observed.holder, observed.recorded) == (
        "unknown",
        None,
        None,
        None,
    )


def test_a_run_that_planned_nothing_puts_the_state_and_record_back(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh"
    with pytest.raises(InputError), holding_run_folder(fresh, what="collect", record=RECORD):
        raise InputError("line 3 is not JSON")
    assert not fresh.exists()  # the lock made the folder and nothing else used it: no trace left

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine\n")
    (existing / RUN_STATE_FILE).write_text('{"older": true}\n')
    with pytest.raises(InputError), holding_run_folder(existing, what="collect", record=RECORD):
        raise InputError("line 3 is not JSON")
    assert sorted(p.name for p in existing.iterdir()) == [RUN_LOCK_FILE, "notes.txt", RUN_STATE_FILE]
    assert (existing / RUN_STATE_FILE).read_text() == '{"older": true}\n'


def test_a_folder_changed_since_the_checks_is_refused_once_locked(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "gym_ray_run.json").write_bytes(b"{}\n")
    with pytest.raises(ResumeError, match=r"changed while this command checked it \(gym_ray_run\.json: "):
        with holding_run_folder(run_dir, what="collect", record=RECORD, expect={"gym_ray_run.json": None}):
            pass
    assert (run_dir / "gym_ray_run.json").read_bytes() == b"{}\n"
    assert not (run_dir / RUN_STATE_FILE).exists()


def test_refuse_if_held_names_the_holder_and_a_probe_never_makes_a_run_fail(tmp_path: Path) -> None:
    refuse_if_held(tmp_path)  # no lock file: nothing to refuse, nothing created
    assert list(tmp_path.iterdir()) == []
    with RunLock(tmp_path, what="collect"):
        with pytest.raises(RunLockError) as refused:
            refuse_if_held(tmp_path)
        assert str(refused.value).startswith(
            f"the run folder {tmp_path} is in use by another run (collect pid {os.getpid()} on host "
        )
    # a status probe that holds a shared flock for a moment: the run's acquire waits it out
    fd = os.open(tmp_path / RUN_LOCK_FILE, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    release = threading.Timer(0.02, lambda: fcntl.flock(fd, fcntl.LOCK_UN))
    release.start()
    try:
        with RunLock(tmp_path, what="collect") as lock:
            assert lock.held
    finally:
        release.join()
        os.close(fd)
    assert json.loads((tmp_path / RUN_LOCK_FILE).read_text())["what"] == "collect"
