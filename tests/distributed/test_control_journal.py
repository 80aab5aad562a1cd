"""Control actors that come back (issue 33 item 3), in one event loop: a driver or coordinator built on the
journal a dead process left takes up its state, and a call Ray sends again is answered as the first was."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray.distributed.coordinator import RunCoordinator
from gym_ray.distributed.driver import ShardDriver
from gym_ray.distributed.journal import CONTROL_DIR, ControlJournal, call_folder, remove_call_folder
from gym_ray.run.collect import ShardSpec
from gym_ray.run.result import ShardReport

pytestmark = pytest.mark.timeout(30)


def _specs(count: int) -> Iterator[ShardSpec]:
    for index in range(count):
        yield ShardSpec(
            run_dir="/unused",
            shard=f"{index:05d}",
            run_id="r1",
            config_identity=None,
            num_rows=10,
            run_rows=40,
        )


async def _first_life(journal: Path) -> None:
    """A driver that hands out, completes, loses a worker and hands out again, then 'dies' (is dropped)."""
    driver = ShardDriver(lambda: _specs(4), lookahead=4, journal=ControlJournal(journal))
    assert (await _shard(driver, "w0", "w0/1"), await _shard(driver, "w1", "w1/1")) == ("00000", "00001")
    assert await driver.shard_finished("w0", "00000") is True
    assert await _shard(driver, "w0", "w0/2") == "00002"
    assert await driver.worker_lost("w1") == ["00001"]
    assert await _shard(driver, "w0", "w0/3") == "00001"
    await driver.close()


async def _shard(driver: ShardDriver, worker: str, ask: str) -> str | None:
    spec = await driver.next_shard(worker, ask)
    return None if spec is None else spec.shard


async def test_a_restarted_driver_takes_up_who_holds_what_and_answers_a_resent_request_the_same(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "driver.jsonl"
    await _first_life(journal)
    driver = ShardDriver(lambda: _specs(4), lookahead=4, journal=ControlJournal(journal))
    # The request w0 sent last, sent again by Ray (the dead process answered it, or only journaled it):
    assert await _shard(driver, "w0", "w0/3") == "00001"
    # A new request gets the one shard nobody holds and nobody completed: 00003, not 00000/00001/00002.
    assert await _shard(driver, "w3", "w3/1") == "00003"
    status = await driver.status()
    assert (status.completed, status.in_flight, status.lost_workers, status.requeued_total) == (
        1,
        {"w0": ("00001", "00002"), "w3": ("00003",)},
        ("w1",),
        1,
    )
    assert status.assignments == {"w0": ("00000", "00002", "00001"), "w1": ("00001",), "w3": ("00003",)}
    # The lost worker's late report is refused; the holders' reports are taken.
    assert await driver.shard_finished("w1", "00001") is False
    for worker, shard in (("w0", "00001"), ("w0", "00002"), ("w3", "00003")):
        assert await driver.shard_finished(worker, shard) is True
    assert await _shard(driver, "w0", "w0/4") is None
    status = await driver.wait_finished()
    assert (status.completed, status.planned_shards, status.planned_rows, status.finished) == (4, 4, 40, True)
    await driver.close()


async def test_a_line_cut_short_by_the_death_is_ignored_and_the_next_starts_a_line(tmp_path: Path) -> None:
    journal = tmp_path / "driver.jsonl"
    await _first_life(journal)
    whole = journal.read_bytes()
    with journal.open("ab") as handle:
        handle.write(b'{"done":"000')  # the process died in the middle of this write: never acted on
    driver = ShardDriver(lambda: _specs(4), lookahead=4, journal=ControlJournal(journal))
    assert await _shard(driver, "w3", "w3/1") == "00003"
    assert journal.read_bytes() == whole + b'{"give":"00003","worker":"w3","ask":"w3/1"}\n'
    assert (await driver.status()).completed == 1
    await driver.close()


def _report(shard: str, succeeded: int, worker: str) -> ShardReport:
    return ShardReport(
        shard=shard,
        planned=10,
        already_done=10 - succeeded,
        dispatched=succeeded,
        succeeded=succeeded,
        failed=0,
        failed_by_class={},
        omitted=0,
        wall_s=0.5,
        worker=worker,
    )


def _coordinator(tmp_path: Path, journal: Path) -> RunCoordinator:
    run: Any = type("Run", (), {"settings": None, "store_url": None})()  # counting reads no setting
    finalize: Any = None
    return RunCoordinator(str(tmp_path), run, finalize_fn=finalize, journal=str(journal))


async def test_a_restarted_coordinator_counts_what_the_dead_one_counted_and_each_shard_once(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "coordinator.jsonl"
    first = _coordinator(tmp_path, journal)
    specs = list(_specs(3))
    for spec in specs[:2]:
        await first.plan_progress(spec)
    first.record_report(_report("00001", 10, "w1"), {"env_a": (10, 7.0)})
    first.record_report(_report("00000", 6, "w0"), {"env_a": (4, 1.0), "env_b": (2, 2.0)})
    first.record_report(_report("00000", 6, "w0"), {"env_a": (4, 1.0), "env_b": (2, 2.0)})  # sent again
    before = await first.status()
    assert (before.shards_done, before.succeeded, before.dispatched, before.already_done) == (2, 16, 16, 4)

    second = _coordinator(tmp_path, journal)  # the restarted process
    for spec in specs:  # a restarted driver plans the folder again: known shards are not added twice
        await second.plan_progress(spec)
    await second.plan_progress(None)
    second.record_report(_report("00000", 6, "w0"), None)  # Ray sends the dead process's last call again
    after = await second.status()
    assert (after.shards_done, after.shards_planned, after.rows_planned, after.plan_done) == (2, 3, 30, True)
    assert (after.succeeded, after.failed, after.dispatched, after.already_done) == (16, 0, 16, 4)
    assert after.by_server == {"env_a": (14, 8.0), "env_b": (2, 2.0)}
    assert after.workers_reporting == ("w0", "w1")
    assert [spec.shard for spec in second._plan().shards] == ["00000", "00001", "00002"]
    assert [t.shard for t in await second.timings()] == ["00001", "00000"]
    assert after.elapsed_s >= before.elapsed_s


def test_each_run_call_has_its_own_journal_folder_removed_at_its_end(tmp_path: Path) -> None:
    first, second = call_folder(tmp_path), call_folder(tmp_path)
    assert first != second
    assert Path(first).parent == tmp_path / CONTROL_DIR
    for folder in (first, second):
        ControlJournal(Path(folder) / "driver.jsonl").append({"lost": "w0"})
    remove_call_folder(first)
    assert sorted(p.name for p in (tmp_path / CONTROL_DIR).iterdir()) == [Path(second).name]
    remove_call_folder(second)
    assert not (tmp_path / CONTROL_DIR).exists()
