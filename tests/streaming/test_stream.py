"""gym_ray.streaming.stream: completion order, backpressure, groups, feeding, closing, worker loss, recording.

Real parts: the package's reference servers on 127.0.0.1 and the session's local Ray (worker actors are
real processes; one is killed with SIGKILL).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import yaml

from gym_ray import keys
from gym_ray.dispatch.outcomes import RolloutFailureRecord
from gym_ray.errors import ConfigError, InputError, ServerConnectionError, UsageError, ValidationError
from gym_ray.record.recorded import recorded_keys
from gym_ray.record.run_lock import RunLock
from gym_ray.record.shard_files import list_shards
from gym_ray.record.status import format_status, run_status
from gym_ray.servers import serve_config, start_in_thread
from gym_ray.streaming.api import stream
from gym_ray.streaming.row_feed import RowFeed
from gym_ray.streaming.sync import stream_sync
from tests.run._cli import dead_config

pytestmark = pytest.mark.ray

AGENTS = {"fast": "fast_agent", "slow": "slow_agent"}


def _config(*, fast_ms: float = 0.0, slow_ms: float = 1500.0) -> dict[str, Any]:
    cfg: dict[str, Any] = {"head_server": {"host": "127.0.0.1", "port": 0}}
    for kind, latency in (("fast", fast_ms), ("slow", slow_ms)):
        agent = AGENTS[kind]
        cfg[agent] = {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 0, "skill": 1.0}}}
        cfg[f"{kind}_env"] = {
            "environment_servers": {
                "example_env": {
                    "host": "127.0.0.1",
                    "port": 0,
                    "skill": 1.0,
                    "latency_ms": latency,
                    "agent_server": {"type": "responses_api_agents", "name": agent},
                }
            }
        }
    return cfg


def _row(a: int, kind: str = "fast") -> dict[str, Any]:
    return {
        "responses_create_params": {"input": [{"role": "user", "content": f"What is {a} + 1?"}]},
        "expected_answer": str(a + 1),
        "difficulty": 0.0,
        "agent_ref": {"name": AGENTS[kind]},
    }


async def _until(check: Callable[[], Any], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await _maybe_await(check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _maybe_await(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


def _task(item: tuple[dict[str, Any], Any]) -> int:
    return int(item[0][keys.TASK_INDEX])


async def test_outcomes_arrive_in_completion_order(ray_session: Any) -> None:
    rows = [_row(i, "slow" if i % 2 == 0 else "fast") for i in range(8)]
    async with serve_config(_config(slow_ms=2000)) as servers:
        async with stream(rows, config=servers.config, num_workers=2, max_in_flight=8) as rollouts:
            items = [item async for item in rollouts]
    order = [_task(item) for item in items]  # type: ignore[arg-type]
    assert set(order[:4]) == {1, 3, 5, 7}
    assert set(order[4:]) == {0, 2, 4, 6}
    for row, outcome in items:  # type: ignore[misc]
        assert outcome["reward"] == 1.0
        server = "slow_env" if row[keys.TASK_INDEX] % 2 == 0 else "fast_env"
        assert outcome[keys.ENVIRONMENT_SERVER] == server
        assert outcome[keys.NG_PERF]["total_latency_ms"] > 0


async def test_backpressure_stops_admission_within_the_buffer_bound(ray_session: Any) -> None:
    consumed, buffer_size, max_in_flight = 5, 3, 4
    bound = consumed + buffer_size + max_in_flight
    async with serve_config(_config()) as servers:
        rollouts = stream(
            [_row(i) for i in range(40)],
            config=servers.config,
            num_workers=2,
            max_in_flight=max_in_flight,
            buffer_size=buffer_size,
        )
        async with rollouts:
            for _ in range(consumed):
                await anext(rollouts)
            await _until(lambda: servers.stats("fast_env").requests == bound, f"{bound} requests")

            async def settled() -> bool:
                return [(w.outbox, w.in_flight, w.credits) for w in await rollouts.worker_stats()] == [
                    (2, 0, 0),
                    (2, 0, 0),
                ]

            # no worker has a credit left and nothing is in flight: a worker admits a row only with a
            # credit, so no request beyond the bound can come (no sleep needed to see that)
            await _until(settled, "both workers out of credits with full outboxes")
            assert servers.stats("fast_env").requests == bound
            stats = rollouts.stats()
            assert (stats.delivered, stats.buffered) == (consumed, buffer_size)


async def test_group_size_delivers_complete_groups(ray_session: Any) -> None:
    async with serve_config(_config()) as servers:
        async with stream(
            [_row(i) for i in range(4)], config=servers.config, group_size=3, max_in_flight=4, buffer_size=2
        ) as rollouts:
            groups = [group async for group in rollouts]
        counts = servers.stats("fast_env").request_counts
    assert len(groups) == 4
    for group in groups:
        assert isinstance(group, list)
        assert [row[keys.ROLLOUT_INDEX] for row, _ in group] == [0, 1, 2]
        assert len({row[keys.TASK_INDEX] for row, _ in group}) == 1
    assert sorted(group[0][0][keys.TASK_INDEX] for group in groups) == [0, 1, 2, 3]
    assert counts == {(t, r): 1 for t in range(4) for r in range(3)}


async def _agen(rows: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for row in rows:
        await asyncio.sleep(0)
        yield row


def _gen(rows: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield from rows


async def test_rows_fed_while_streaming(ray_session: Any) -> None:
    async with serve_config(_config()) as servers:
        feed = RowFeed()
        async with stream(feed, config=servers.config, max_in_flight=4) as rollouts:
            feed.put_many([_row(0), _row(1)])
            first = {_task(await anext(rollouts)), _task(await anext(rollouts))}  # type: ignore[arg-type]
            assert rollouts.stats().read == 2
            feed.put_many([_row(2), _row(3)])
            feed.close()
            rest = {_task(item) async for item in rollouts}  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="after close"):
            feed.put(_row(4))
        assert (first, rest) == ({0, 1}, {2, 3})
        for source in (_agen([_row(5), _row(6)]), _gen([_row(7)])):
            async with stream(source, config=servers.config, max_in_flight=2) as rollouts:
                assert sorted([_task(item) async for item in rollouts]) == (  # type: ignore[arg-type]
                    [0, 1] if isinstance(source, AsyncIterator) else [0]
                )


async def test_aclose_cancels_server_handlers_on_every_worker(ray_session: Any) -> None:
    async with serve_config(_config(fast_ms=20_000)) as servers:
        rollouts = stream([_row(i) for i in range(10)], config=servers.config, num_workers=2, max_in_flight=4)
        await rollouts.start()
        await _until(lambda: servers.stats("fast_env").in_flight == 4, "4 handlers running")

        async def both_full() -> bool:
            return [w.in_flight for w in await rollouts.worker_stats()] == [2, 2]

        await _until(both_full, "2 rollouts in flight on each worker")
        await rollouts.aclose()
        await _until(lambda: servers.stats("fast_env").cancelled == 4, "4 cancelled handlers")
        stats = servers.stats("fast_env")
        assert (stats.requests, stats.in_flight, stats.completed) == (4, 0, 0)
        with pytest.raises(StopAsyncIteration):
            await anext(rollouts)


async def test_cancelling_the_consumer_like_a_cell_interrupt_cancels_every_worker(ray_session: Any) -> None:
    async with serve_config(_config(fast_ms=20_000)) as servers:
        rollouts = stream([_row(i) for i in range(10)], config=servers.config, num_workers=2, max_in_flight=4)

        async def consume() -> None:
            async for _ in rollouts:
                pass

        consumer = asyncio.create_task(consume())  # the notebook cell
        await _until(lambda: servers.stats("fast_env").in_flight == 4, "4 handlers running")
        consumer.cancel()  # what Jupyter's interrupt does to the awaiting cell
        with pytest.raises(asyncio.CancelledError):
            await consumer
        await _until(lambda: servers.stats("fast_env").cancelled == 4, "4 cancelled handlers")
        stats = servers.stats("fast_env")
        assert (stats.requests, stats.in_flight, stats.completed) == (4, 0, 0)
        with pytest.raises(StopAsyncIteration):
            await anext(rollouts)


async def test_aclose_and_drain_returns_completed_outcomes_once(ray_session: Any) -> None:
    rows = [_row(i, "slow" if i >= 4 else "fast") for i in range(6)]
    async with serve_config(_config(slow_ms=20_000)) as servers:
        rollouts = stream(rows, config=servers.config, num_workers=2, max_in_flight=6, buffer_size=6)
        first = _task(await anext(rollouts))  # type: ignore[arg-type]
        await _until(lambda: servers.stats("slow_env").in_flight == 2, "both slow rows in flight")

        async def fast_done() -> bool:
            return sum(w.finished for w in await rollouts.worker_stats()) == 4

        await _until(fast_done, "the 4 fast rows finished")
        drained = await rollouts.aclose_and_drain()
        assert sorted(_task(item) for item in drained) == sorted({0, 1, 2, 3} - {first})  # type: ignore[arg-type]
        assert all(not isinstance(outcome, RolloutFailureRecord) for _, outcome in drained)  # type: ignore[misc]
        assert await rollouts.aclose_and_drain() == []
        await _until(lambda: servers.stats("slow_env").cancelled == 2, "2 slow handlers cancelled")


async def test_killed_worker_rows_are_rerun_and_delivered_once(ray_session: Any) -> None:
    async with serve_config(_config(fast_ms=300)) as servers:
        rollouts = stream([_row(i) for i in range(16)], config=servers.config, num_workers=2, max_in_flight=4)
        async with rollouts:
            delivered = [_task(await anext(rollouts))]  # type: ignore[arg-type]
            victim = (await rollouts.worker_pids())[0]
            os.kill(victim, signal.SIGKILL)
            delivered += [_task(item) async for item in rollouts]  # type: ignore[arg-type]
            stats = rollouts.stats()
        counts = servers.stats("fast_env").request_counts
    assert sorted(delivered) == list(range(16))
    assert (stats.workers_lost, stats.delivered) == (1, 16)
    assert stats.requeued >= 1
    assert set(counts) == {(t, 0) for t in range(16)}
    # each row reached a server once, plus at most once more per requeue of its undelivered outcome
    assert 16 <= sum(counts.values()) <= 16 + stats.requeued


async def test_record_dir_and_resume(ray_session: Any, tmp_path: Any) -> None:
    run_dir = tmp_path / "run"
    async with serve_config(_config()) as servers:
        async with stream([_row(i) for i in range(6)], config=servers.config, record_dir=run_dir) as rollouts:
            first = sorted([_task(item) async for item in rollouts])  # type: ignore[arg-type]
        assert first == list(range(6))
        assert recorded_keys(run_dir) == {(t, 0) for t in range(6)}
        servers.reset_stats()
        rows = [_row(i) for i in range(8)]
        async with stream(rows, config=servers.config, record_dir=run_dir, resume=True) as rollouts:
            second = sorted([_task(item) async for item in rollouts])  # type: ignore[arg-type]
            assert (rollouts.stats().skipped, rollouts.stats().read) == (6, 2)
        assert second == [6, 7]
        assert set(servers.stats("fast_env").request_counts) == {(6, 0), (7, 0)}
    assert recorded_keys(run_dir) == {(t, 0) for t in range(8)}


def test_stream_sync_for_plain_loops(ray_session: Any) -> None:
    with start_in_thread(_config()) as servers:
        with stream_sync([_row(i) for i in range(3)], config=servers.config, max_in_flight=2) as rollouts:
            tasks = sorted(_task(item) for item in rollouts)  # type: ignore[arg-type]
    assert tasks == [0, 1, 2]


@pytest.mark.parametrize(
    ("row", "error", "match"),
    [
        pytest.param(["not", "a", "dict"], InputError, "stream input row 0 is a list", id="not-a-dict"),
        pytest.param({**_row(0), "agent_ref": {"name": "nope"}}, ValidationError, "nope", id="unknown-agent"),
    ],
)
async def test_bad_rows_raise_to_the_consumer(ray_session: Any, row: Any, error: type, match: str) -> None:
    async with serve_config(_config()) as servers:
        rollouts = stream([row], config=servers.config, num_workers=1, max_in_flight=1)
        with pytest.raises(error, match=match):
            await anext(rollouts)
        await rollouts.aclose()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        pytest.param({"max_in_flight": 1, "num_workers": 2}, "max_in_flight=1 must be an int >= 2", id="mif"),
        pytest.param({"group_size": 0}, "group_size=0", id="group"),
        pytest.param({"resume": True}, "resume=True needs record_dir", id="resume"),
        pytest.param({"timeout_s": 0}, "timeout_s=0", id="timeout"),
    ],
)
def test_bad_options_are_usage_errors(options: dict[str, Any], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        stream([], config={}, **options)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        pytest.param(
            {"num_repeats": 4, "output_dir": "runs/r1"},
            "stream: the config sets run setting(s) num_repeats, output_dir, which a stream does not read "
            "(num_repeats: pass group_size=... to gym_ray.stream; output_dir: pass record_dir=... to "
            "gym_ray.stream); remove them from the config given to gym_ray.stream",
            id="settings",
        ),
        pytest.param(
            {"seed": 7},
            "stream: the config sets run setting(s) seed, which a stream does not read (seed: a stream does "
            "not use it); remove them from the config given to gym_ray.stream",
            id="unused",
        ),
        pytest.param(
            {"tracing": {"enabled": True}},
            "stream: the config has a tracing: block, but streams do not trace or export metrics yet; "
            "remove it from the config given to gym_ray.stream",
            id="tracing",
        ),
    ],
)
async def test_run_settings_in_a_stream_config_are_refused_before_ray_and_free_the_folder(
    tmp_path: Any, extra: dict[str, Any], message: str
) -> None:
    # A stream has options of its own for these: silently ignoring `num_repeats: 4` would run each row
    # once. The refusal comes before Ray or any server is touched, and leaves record_dir free.
    with start_in_thread(_config()) as servers:
        config = {**servers.config, **extra}
        with pytest.raises(ConfigError) as raised:
            async with stream([_row(1)], config=config, record_dir=tmp_path):
                pass
        assert str(raised.value) == message
        assert servers.stats("fast_env").completed == 0
    RunLock(tmp_path, what="stream").acquire().release()  # RunLockError if the refused stream held it


async def test_a_server_that_is_not_running_is_refused_at_start_in_one_line(
    ray_session: Any, tmp_path: Any
) -> None:
    # The config's server is on a port nothing listens on (a typo, a server not started yet): without the
    # check the stream would start its workers and wait out the 300 s outage timeout.
    dead = yaml.safe_load(dead_config(tmp_path / "dead.yaml").read_text())
    port = dead["arith_env"]["environment_servers"]["example_env"]["port"]
    rows = [{**_row(1), "agent_ref": {"name": "arith_agent"}}]
    with pytest.raises(ServerConnectionError) as raised:
        async with stream(rows, config=dead, record_dir=tmp_path / "out"):
            pass
    assert str(raised.value) == (
        f"environment server 'arith_env' at http://127.0.0.1:{port} is not reachable (Connection refused); "
        "start it (gym-ray serve CONFIG) or fix its host/port in the config (or skip this check: "
        "--no-health-check / health_check=false)"
    )
    assert not (tmp_path / "out").exists()  # nothing written
    # health_check=False: the stream starts; rows for the server wait while it is down.
    async with stream(rows, config=dead, num_workers=1, max_in_flight=1, health_check=False) as waiting:
        assert len(await waiting.worker_pids()) == 1


async def test_stream_sync_refuses_a_running_loop() -> None:
    with pytest.raises(UsageError, match="running event loop"):
        stream_sync([], config={})


async def test_a_used_record_dir_is_refused_without_resume_and_freed(ray_session: Any, tmp_path: Any) -> None:
    run_dir = tmp_path / "run"
    async with serve_config(_config()) as servers:
        async with stream([_row(0)], config=servers.config, record_dir=run_dir) as rollouts:
            [item async for item in rollouts]
        (shard,) = list_shards(run_dir)
        again = stream([_row(0)], config=servers.config, record_dir=run_dir)
        with pytest.raises(UsageError) as refused:
            await again.start()
        assert str(refused.value) == (
            f"stream: record_dir {run_dir} already holds 1 recording(s) ({shard}); pass resume=True to skip "
            "what they hold (same input order), or give a new record_dir"
        )
        assert list_shards(run_dir) == [shard]  # nothing added
        text = format_status(run_status(run_dir))
        assert text.splitlines()[:2] == [
            "state: a stream's recording (it holds the rollouts the stream delivered and plans nothing "
            "ahead; gym_ray.stream(rows, record_dir=..., resume=True) continues it)",
            f"run {run_dir}: 1 shard(s), 1 rollout(s) succeeded and 0 failure record(s) delivered",
        ]
        assert "cannot be resumed" not in text
        assert "resume would run" not in text
        async with stream([_row(0)], config=servers.config, record_dir=run_dir, resume=True) as rollouts:
            assert [item async for item in rollouts] == []  # the folder was freed; resume skips task 0
