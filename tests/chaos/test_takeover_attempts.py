"""Issue 29: a shard taken over (or resumed) while rows are in flight re-sends them with a new attempt index.

An environment server that deduplicates on ``(task, rollout, attempt)`` must never see the same triple
twice from one run: every ``/run`` a shard's owner sends carries an attempt index no earlier owner of the
shard may have sent for that rollout. And a late result of an older attempt never supersedes a newer
one: the shard keeps exactly one record per rollout, the newest attempt's (the old owner's late write is
refused by the shard lock's token check).

The server (:class:`GatedEnv`, a real aiohttp server on 127.0.0.1) logs every ``/run`` body's
``(task, rollout, attempt)`` and holds the *first* request of each held rollout until the test releases
it; every later request is answered at once. Nothing here sleeps: the test waits on the server's and the
run's own events.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gym_ray import keys
from gym_ray.config.run_config import RunConfig, resolve_run_config
from gym_ray.distributed.api import RunActors, plan_from_config, run_actors
from gym_ray.distributed.driver import DriverStatus
from gym_ray.errors import ShardLockError
from gym_ray.plan.shards import ShardSpec, prepare_run
from gym_ray.record.ledger import check_run
from gym_ray.record.shard_files import shard_paths
from gym_ray.run.collect import client_for, run_shard

pytestmark = pytest.mark.timeout(120)

WAIT_S = 60.0
Sent = tuple[int, int, int]  # (task, rollout, attempt) of one /run body


class GatedEnv:
    """A ``/run`` server in a thread of its own: logs each body's ``(task, rollout, attempt)``; the first
    request of a held task waits for :meth:`release`, every other request is answered at once."""

    def __init__(self, held_tasks: set[int]) -> None:
        self.held_tasks = held_tasks
        self.sent: list[Sent] = []
        self.port = 0
        self._lock = threading.Lock()
        self._holding = 0
        self.all_held = threading.Event()  # every held task's first request has arrived
        self.all_resent = threading.Event()  # every held task has been sent again
        self._resent = 0
        self._release = asyncio.Event()  # bound to the server's loop when first awaited there
        self._stop = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="gated-env", daemon=True)
        self.error: BaseException | None = None

    async def _run(self, request: web.Request) -> web.Response:
        body = await request.json()
        sent = (body[keys.TASK_INDEX], body[keys.ROLLOUT_INDEX], body.get(keys.ATTEMPT_INDEX, 0))
        with self._lock:
            first = all(s[:2] != sent[:2] for s in self.sent)
            self.sent.append(sent)
            held = first and sent[0] in self.held_tasks
            if held:
                self._holding += 1
                if self._holding == len(self.held_tasks):
                    self.all_held.set()
            elif sent[0] in self.held_tasks and sum(s[:2] == sent[:2] for s in self.sent) == 2:
                self._resent += 1
                if self._resent == len(self.held_tasks):
                    self.all_resent.set()
        if held:
            await self._release.wait()
        return web.json_response({"reward": 1.0, "answered": "late" if held else "at once"})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    def _serve(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by running(), which would otherwise only time out
            self.error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        app = web.Application()
        app.router.add_get("/", self._health)
        app.router.add_post("/run", self._run)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = runner.addresses[0][1]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def release(self) -> None:
        """Answer the held requests (their results reach the old owner late)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._release.set)

    def sent_by_rollout(self) -> dict[tuple[int, int], list[int]]:
        """Attempt indices the server received per ``(task, rollout)``, in arrival order."""
        with self._lock:
            out: dict[tuple[int, int], list[int]] = {}
            for task, rollout, attempt in self.sent:
                out.setdefault((task, rollout), []).append(attempt)
            return out

    @contextlib.contextmanager
    def running(self) -> Iterator[GatedEnv]:
        self._thread.start()
        assert self._ready.wait(WAIT_S)
        assert self.error is None, self.error
        try:
            yield self
        finally:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._release.set)
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(WAIT_S)


def config_of(port: int) -> dict[str, Any]:
    """One agent fronted by one environment server, both the gated server."""
    return {
        "calc_agent": {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": port}}},
        "calc_env": {
            "environment_servers": {
                "example_env": {
                    "host": "127.0.0.1",
                    "port": port,
                    "agent_server": {"type": "responses_api_agents", "name": "calc_agent"},
                }
            }
        },
    }


def rows_of(n: int) -> list[dict[str, Any]]:
    return [
        {
            "responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 1?"}]},
            "agent_ref": {"name": "calc_agent"},
        }
        for i in range(n)
    ]


def records_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


async def wait_for(event: threading.Event, what: str) -> None:
    if not await asyncio.to_thread(event.wait, WAIT_S):
        raise AssertionError(f"gave up waiting for {what}")


@contextlib.asynccontextmanager
async def one_shard(tmp_path: Path, env: GatedEnv, rows: int) -> AsyncIterator[tuple[RunConfig, ShardSpec]]:
    run = await resolve_run_config(
        config_of(env.port),
        settings={"output_dir": str(tmp_path), "shard_size": rows, "max_resident_tasks": 16},
    )
    plan = prepare_run(run, rows=rows_of(rows))
    assert [spec.num_rows for spec in plan.shards] == [rows]
    yield run, plan.shards[0]


HELD = {2, 3, 4, 5}  # tasks whose first /run is held; tasks 0 and 1 are answered at once


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("taken-over", id="taken-over"),  # a second owner opens the shard while the first runs
        pytest.param("stopped", id="stopped"),  # the first owner is cancelled (Ctrl-C), the rerun resumes
    ],
)
async def test_a_shard_reopened_with_rows_in_flight_sends_them_again_with_a_new_attempt_index(
    tmp_path: Path, how: str
) -> None:
    with GatedEnv(HELD).running() as env:
        async with one_shard(tmp_path, env, 6) as (run, spec):
            recorded_two = threading.Event()
            first_records: list[dict[str, Any]] = []

            def first_outcome(row: dict[str, Any], record: dict[str, Any]) -> None:
                first_records.append(record)
                if len(first_records) == 2:
                    recorded_two.set()

            async with client_for(run) as client_a, client_for(run) as client_b:
                first = asyncio.ensure_future(
                    run_shard(spec, client=client_a, run=run, on_outcome=first_outcome, worker="old")
                )
                # The first owner has recorded tasks 0 and 1 and holds tasks 2-5 in flight.
                await wait_for(env.all_held, "the held requests to reach the server")
                await wait_for(recorded_two, "the first owner to record tasks 0 and 1")
                if how == "stopped":
                    first.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await first
                second = await run_shard(spec, client=client_b, run=run, worker="new")
                assert (second.already_done, second.dispatched, second.succeeded) == (2, 4, 4)
                if how == "taken-over":
                    # The old owner's late results arrive after the new owner recorded the rollouts: its
                    # first late append is refused, and it writes nothing.
                    env.release()
                    with pytest.raises(ShardLockError):
                        await first
        sent = env.sent_by_rollout()

    # The re-sent rollouts carry an attempt index the first owner never sent; the others were sent once.
    assert sent == {
        (0, 0): [0],
        (1, 0): [0],
        (2, 0): [0, 1],
        (3, 0): [0, 1],
        (4, 0): [0, 1],
        (5, 0): [0, 1],
    }
    # Exactly one record per rollout, the newest attempt's: no late result replaced or duplicated one.
    paths = shard_paths(tmp_path, spec.shard)
    successes = records_of(paths.successes)
    assert sorted(
        (r[keys.TASK_INDEX], r[keys.ROLLOUT_INDEX], r.get(keys.ATTEMPT_INDEX, 0), r["answered"])
        for r in successes
    ) == [
        (0, 0, 0, "at once"),
        (1, 0, 0, "at once"),
        (2, 0, 1, "at once"),
        (3, 0, 1, "at once"),
        (4, 0, 1, "at once"),
        (5, 0, 1, "at once"),
    ]
    assert records_of(paths.failures) == []
    report = check_run(tmp_path)
    assert (report.lost, report.missing, report.duplicates, report.unexpected, report.corrupt_lines) == (
        0,
        0,
        0,
        0,
        0,
    )


async def test_rows_drained_unsent_are_not_announced_and_run_later_with_attempt_0(tmp_path: Path) -> None:
    with GatedEnv(set()).running() as env:
        async with one_shard(tmp_path, env, 3) as (run, spec):
            # every row's turn comes with less time left than the drain margin: none is sent
            drain_all = run.with_settings(dispatch_budget_s=600.0, drain_margin_s=600.0)
            async with client_for(run) as client:
                drained = await run_shard(spec, client=client, run=drain_all)
                assert (drained.dispatched, drained.omitted) == (3, 3)
                assert not shard_paths(tmp_path, spec.shard).attempt_log.exists()
                sent_later = await run_shard(spec, client=client, run=run)
                assert (sent_later.dispatched, sent_later.succeeded) == (3, 3)
        sent = env.sent_by_rollout()
    assert sent == {(task, 0): [0] for task in range(3)}


@pytest.mark.ray
async def test_a_worker_that_takes_over_a_shard_sends_its_in_flight_rows_with_a_new_attempt_index(
    ray_session: Any, tmp_path: Path
) -> None:
    """R18's takeover on Ray: the driver re-queues the shard of a worker whose rows are all in flight (as
    when its node stops answering); the other worker re-sends them with attempt 1, and the old owner's late
    results are refused."""
    tasks = {0, 1, 2, 3}
    started: list[RunActors] = []
    with GatedEnv(tasks).running() as env:
        run = await resolve_run_config(
            config_of(env.port),
            settings={
                "output_dir": str(tmp_path),
                "shard_size": len(tasks),
                "max_resident_tasks": 8,
                "disable_aggregation": True,
            },
        )
        collection = asyncio.ensure_future(
            run_actors(
                run,
                functools.partial(plan_from_config, run, ray_session.put(rows_of(len(tasks)))),
                run_dir=str(tmp_path),
                num_workers=2,
                on_started=started.append,
            )
        )
        try:
            # The shard's owner has every row in flight, held at the server.
            await wait_for(env.all_held, "every row's first request to reach the server")
            assert started
            driver = started[0].driver
            status: DriverStatus = await driver.status.remote()
            ((owner, (shard,)),) = [(w, s) for w, s in status.in_flight.items() if s]
            assert await driver.worker_lost.remote(owner) == [shard]
            # The other worker takes the shard over and sends every row again; then the old owner's
            # requests are answered, late.
            await wait_for(env.all_resent, "the new owner to send the rows again")
            env.release()
            result = await collection
        finally:
            collection.cancel()
        sent = env.sent_by_rollout()

    assert sent == {(task, 0): [0, 1] for task in tasks}
    refused = [f.error_type for f in started[0].totals[owner].failures if f.shard == shard]
    assert refused == [ShardLockError.__name__]
    successes = records_of(shard_paths(tmp_path, shard).successes)
    assert sorted(
        (r[keys.TASK_INDEX], r[keys.ROLLOUT_INDEX], r[keys.ATTEMPT_INDEX], r["answered"]) for r in successes
    ) == [(task, 0, 1, "at once") for task in sorted(tasks)]
    assert (result.planned, result.succeeded, result.failed, result.complete) == (4, 4, 0, True)
    report = check_run(tmp_path)
    assert (report.lost, report.missing, report.duplicates, report.unexpected) == (0, 0, 0, 0)
