"""Async RL on the stream: policy versions, pause (drain / abort), staleness, next_batch, group filters.

Real parts: the package's reference servers on 127.0.0.1 (per-server counts of requests, running and
cancelled handlers), the session's local Ray with 2 stream workers, real run folders in tmp_path.
Waits are on conditions (server counters, stream and worker stats), never on a fixed time; the one-second
sleeps only give a violation of "nothing new happens" room to show up.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from typing import Any

import aiohttp
import pytest

from gym_ray import keys
from gym_ray.errors import UsageError
from gym_ray.record.jsonl import JsonlReader
from gym_ray.record.shard_files import list_shards, shard_paths
from gym_ray.servers import serve_config
from gym_ray.streaming.api import stream
from gym_ray.streaming.groups import RolloutGroup
from gym_ray.streaming.sync import stream_sync
from tests.streaming.test_stream import _config, _row
from tests.streaming.test_stream import _until as _until_30s

pytestmark = pytest.mark.ray


async def _until(check: Any, what: str) -> None:
    await _until_30s(check, what, timeout_s=120.0)  # the machine is shared: be generous


def _key(item: tuple[dict[str, Any], Any]) -> tuple[int, int]:
    return int(item[0][keys.TASK_INDEX]), int(item[0][keys.ROLLOUT_INDEX])


def _version(item: tuple[dict[str, Any], Any]) -> int:
    return int(item[0][keys.POLICY_VERSION])


async def _set_latency(servers: Any, name: str, latency_ms: float) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(servers.url_of(name) + "/policy", json={"latency_ms": latency_ms}) as reply:
            assert reply.status == 200
            assert (await reply.json())["latency_ms"] == latency_ms


async def test_pause_drain_finishes_in_flight_and_admits_nothing_until_resume(ray_session: Any) -> None:
    rows = [_row(i) for i in range(12)]
    async with serve_config(_config(fast_ms=1500)) as servers:
        async with stream(rows, config=servers.config, num_workers=2, max_in_flight=4) as rollouts:
            await _until(lambda: servers.stats("fast_env").in_flight == 4, "4 handlers running")
            await rollouts.pause("drain")
            sent = servers.stats("fast_env").requests
            assert sent >= 4
            # drain: every admitted rollout has finished by the time pause() returns
            assert servers.stats("fast_env").completed == sent
            assert [(w.paused, w.in_flight) for w in await rollouts.worker_stats()] == [(True, 0), (True, 0)]
            paused_items = [await anext(rollouts) for _ in range(sent)]  # pulled while paused
            await asyncio.sleep(1.0)  # room for a /run the pause failed to stop
            assert servers.stats("fast_env").requests == sent
            stats = rollouts.stats()
            assert (stats.paused, stats.delivered, stats.aborted) == (True, sent, 0)
            assert stats.paused_s > 0
            await rollouts.resume()
            assert rollouts.stats().paused is False
            rest = [item async for item in rollouts]
        counts = servers.stats("fast_env").request_counts
    keys_seen = [_key(item) for item in [*paused_items, *rest]]  # type: ignore[arg-type]
    assert sorted(keys_seen) == [(t, 0) for t in range(12)]
    assert counts == {(t, 0): 1 for t in range(12)}


async def test_pause_abort_cancels_exactly_the_in_flight_handlers_and_reruns_them_once(
    ray_session: Any,
) -> None:
    rows = [_row(i, "slow") for i in range(6)]
    async with serve_config(_config(slow_ms=60_000)) as servers:
        async with stream(rows, config=servers.config, num_workers=2, max_in_flight=4) as rollouts:

            async def both_full() -> bool:
                return [w.in_flight for w in await rollouts.worker_stats()] == [2, 2]

            await _until(lambda: servers.stats("slow_env").in_flight == 4, "4 handlers running")
            await _until(both_full, "2 rollouts in flight on each worker")
            running = set(servers.stats("slow_env").request_counts)
            await rollouts.pause("abort")
            await _until(lambda: servers.stats("slow_env").cancelled == 4, "the 4 handlers cancelled")
            await asyncio.sleep(1.0)  # room for a /run the pause failed to stop
            slow = servers.stats("slow_env")
            assert (slow.requests, slow.cancelled, slow.completed, slow.in_flight) == (4, 4, 0, 0)
            assert rollouts.stats().aborted == 4
            assert [w.aborted for w in await rollouts.worker_stats()] == [2, 2]
            await rollouts.set_policy_version(1)  # the weight sync
            await _set_latency(servers, "slow_env", 0)
            await rollouts.resume()
            items = [item async for item in rollouts]
        counts = servers.stats("slow_env").request_counts
    assert sorted(_key(item) for item in items) == [(t, 0) for t in range(6)]  # type: ignore[arg-type]
    assert counts == {(t, 0): 2 if (t, 0) in running else 1 for t in range(6)}
    assert [_version(item) for item in items] == [1] * 6  # type: ignore[arg-type]
    assert [o[keys.POLICY_VERSION] for _, o in items] == [1] * 6  # type: ignore[misc]


async def test_delivered_outcomes_stay_within_max_staleness(ray_session: Any) -> None:
    seen_stale: list[tuple[int, int]] = []

    def keep(row: dict[str, Any], outcome: Any) -> None:
        seen_stale.append((row[keys.TASK_INDEX], row[keys.POLICY_VERSION]))

    rows = [_row(i) for i in range(8)]
    async with serve_config(_config()) as servers:
        rollouts = stream(
            rows,
            config=servers.config,
            num_workers=2,
            max_in_flight=4,
            buffer_size=8,
            max_staleness=1,
            on_stale=keep,
        )
        async with rollouts:
            await _until(lambda: rollouts.stats().buffered == 8, "8 rollouts finished under version 0")
            await rollouts.set_policy_version(1)
            first = [(await anext(rollouts), rollouts.policy_version) for _ in range(2)]
            await rollouts.set_policy_version(2)
            rest = [(item, rollouts.policy_version) async for item in rollouts]
            stats = rollouts.stats()
        counts = servers.stats("fast_env").request_counts
    delivered = [*first, *rest]
    for item, current in delivered:
        assert current - _version(item) <= 1  # type: ignore[arg-type]
    assert [_version(item) for item, _ in first] == [0, 0]  # type: ignore[arg-type]
    assert [_version(item) for item, _ in rest] == [2] * 6  # type: ignore[arg-type]
    assert sorted(_key(item) for item, _ in delivered) == [(t, 0) for t in range(8)]  # type: ignore[arg-type]
    first_tasks = {_key(item)[0] for item, _ in first}  # type: ignore[arg-type]
    assert sorted(seen_stale) == sorted((t, 0) for t in range(8) if t not in first_tasks)
    assert counts == {(t, 0): 1 if t in first_tasks else 2 for t in range(8)}
    assert (stats.stale, stats.delivered, stats.staleness) == (6, 8, {0: 6, 1: 2})


@pytest.mark.parametrize(
    "carry_over", [pytest.param(False, id="cancel"), pytest.param(True, id="carry-over")]
)
async def test_next_batch_returns_while_the_slowest_groups_still_run(
    ray_session: Any, carry_over: bool
) -> None:
    rows = [_row(0, "slow"), _row(1, "slow"), *(_row(i) for i in range(2, 6))]
    async with serve_config(_config(slow_ms=60_000)) as servers:
        rollouts = stream(rows, config=servers.config, group_size=2, max_in_flight=12)
        async with rollouts:
            batch = await rollouts.next_batch(4, oversample=1.5, carry_over=carry_over)
            assert rollouts.stats().read == 12  # ceil(4 * 1.5) = 6 groups of 2 read
            assert all(isinstance(g, RolloutGroup) and len(g) == 2 for g in batch)
            assert sorted(g.task_index for g in batch) == [2, 3, 4, 5]  # type: ignore[union-attr]
            if not carry_over:
                await _until(lambda: servers.stats("slow_env").cancelled == 4, "the slow groups' 4 handlers")
                slow = servers.stats("slow_env")
                assert (slow.requests, slow.completed, slow.in_flight) == (4, 0, 0)
                assert (rollouts.stats().cancelled, rollouts.stats().carried_over) == (2, 0)
                assert await rollouts.next_batch(4) == []  # the input has ended: nothing left
            else:
                assert (rollouts.stats().cancelled, rollouts.stats().carried_over) == (0, 2)
                assert servers.stats("slow_env").cancelled == 0
                await _set_latency(servers, "slow_env", 0)
                await rollouts.pause("abort")  # the carried groups run again, fast, after resume
                await rollouts.resume()
                second = await rollouts.next_batch(4)
                assert sorted(g.task_index for g in second) == [0, 1]  # type: ignore[union-attr]
            assert rollouts.stats().delivered == (8 if not carry_over else 12)
        fast = servers.stats("fast_env").request_counts
    assert fast == {(t, r): 1 for t in range(2, 6) for r in range(2)}


async def test_uniform_reward_groups_are_filtered_and_replaced(ray_session: Any) -> None:
    import gym_ray

    cfg = _config()
    cfg["fast_env"]["environment_servers"]["example_env"]["skill"] = 0.5
    # difficulty 0 is always right (a uniform group); difficulty 1 at skill 0.5 is right half the time.
    rows = [{**_row(0), "difficulty": 0.0}, *({**_row(i), "difficulty": 1.0} for i in range(1, 10))]
    async with serve_config(cfg) as servers:
        async with stream(rows, config=servers.config, group_size=4, max_in_flight=8) as rollouts:
            reference = {g.task_index: g.rewards async for g in rollouts}  # type: ignore[union-attr]
        uniform = {t for t, rewards in reference.items() if len(set(rewards)) == 1}
        assert 0 in uniform
        assert len(uniform) < len(rows) - 3  # the seeded draws leave at least 3 mixed groups
        rollouts = stream(
            rows,
            config=servers.config,
            group_size=4,
            max_in_flight=8,
            group_filter=gym_ray.drop_uniform_reward,
            max_groups_in_flight=3,
        )
        async with rollouts:
            batch = await rollouts.next_batch(3)
            rest = [g async for g in rollouts]
            stats = rollouts.stats()
    assert len(batch) == 3
    delivered = [g.task_index for g in [*batch, *rest]]  # type: ignore[union-attr]
    assert sorted(delivered) == sorted(set(range(10)) - uniform)
    assert stats.filtered == {"drop_uniform_reward": len(uniform)}
    assert stats.delivered == 4 * (10 - len(uniform))


def _recorded(run_dir: Any) -> Counter[tuple[int, int]]:
    lines: Counter[tuple[int, int]] = Counter()
    for shard in list_shards(run_dir):
        for _, record in JsonlReader(shard_paths(run_dir, shard).successes):
            lines[(record[keys.TASK_INDEX], record[keys.ROLLOUT_INDEX])] += 1
            assert isinstance(record[keys.POLICY_VERSION], int)
    return lines


async def test_crash_and_resume_records_every_delivered_rollout_exactly_once(
    ray_session: Any, tmp_path: Any
) -> None:
    run_dir = tmp_path / "run"
    rows = [_row(i) for i in range(16)]
    async with serve_config(_config(fast_ms=200)) as servers:
        rollouts = stream(rows, config=servers.config, max_in_flight=4, record_dir=run_dir, max_staleness=0)

        async def take(n: int) -> list[Any]:
            return [(await anext(rollouts), rollouts.policy_version) for _ in range(n)]

        delivered = await take(3)
        await rollouts.set_policy_version(1)  # what was finished under version 0 runs again
        delivered += await take(3)
        os.kill((await rollouts.worker_pids())[0], signal.SIGKILL)
        delivered += await take(3)
        assert rollouts.stats().workers_lost == 1
        await rollouts.aclose()  # the trainer goes away: finished, undelivered outcomes are dropped
        assert all(_version(item) == current for item, current in delivered)  # max_staleness=0
        first = Counter(_key(item) for item, _ in delivered)
        assert _recorded(run_dir) == first
        assert all(v == 1 for v in first.values())
        async with stream(
            rows, config=servers.config, max_in_flight=4, record_dir=run_dir, resume=True
        ) as again:
            second = [_key(item) async for item in again]  # type: ignore[arg-type]
            assert again.stats().skipped == 9
    assert sorted([*first, *second]) == [(t, 0) for t in range(16)]
    assert _recorded(run_dir) == Counter({(t, 0): 1 for t in range(16)})


def test_sync_wrapper_pauses_versions_and_batches(ray_session: Any) -> None:
    from gym_ray.servers import start_in_thread

    with start_in_thread(_config()) as servers:
        rollouts = stream_sync(
            [_row(i) for i in range(6)], config=servers.config, group_size=2, max_in_flight=4
        )
        with rollouts:
            rollouts.pause("drain")
            rollouts.set_policy_version(3)
            rollouts.resume()
            batch = rollouts.next_batch(3)
            assert (rollouts.stats().policy_version, rollouts.stats().delivered) == (3, 6)
            rest = list(rollouts)
    assert len(batch) == 3
    assert sorted(g.task_index for g in [*batch, *rest]) == list(range(6))  # type: ignore[union-attr]


async def test_a_worker_that_replaces_a_dead_one_starts_paused(ray_session: Any) -> None:
    rows = [_row(i) for i in range(10)]
    async with serve_config(_config(fast_ms=500)) as servers:
        async with stream(rows, config=servers.config, num_workers=2, max_in_flight=4) as rollouts:
            await _until(lambda: servers.stats("fast_env").in_flight == 4, "4 handlers running")
            await rollouts.pause("drain")
            sent = servers.stats("fast_env").requests
            os.kill((await rollouts.worker_pids())[0], signal.SIGKILL)
            await _until(lambda: rollouts.stats().workers_lost == 1, "the dead worker replaced")

            async def replaced_and_paused() -> bool:
                workers = await rollouts.worker_stats()
                return [w.worker for w in workers] == ["w0.1", "w1.0"] and all(w.paused for w in workers)

            await _until(replaced_and_paused, "the replacement up and paused")
            await asyncio.sleep(1.0)  # room for a /run the pause failed to stop
            assert servers.stats("fast_env").requests == sent
            await rollouts.resume()
            items = [item async for item in rollouts]
    assert sorted(_key(item) for item in items) == [(t, 0) for t in range(10)]  # type: ignore[arg-type]


async def test_next_batch_timeout_returns_what_is_complete_and_the_stream_goes_on(ray_session: Any) -> None:
    async with serve_config(_config(slow_ms=60_000)) as servers:
        rollouts = stream([_row(0, "slow"), _row(1)], config=servers.config, group_size=2, max_in_flight=4)
        async with rollouts:
            await _until(lambda: servers.stats("slow_env").in_flight == 2, "the slow group running")
            await _until(lambda: rollouts.stats().buffered == 2, "the fast group complete")
            batch = await rollouts.next_batch(2, timeout_s=0.5)
            assert [g.task_index for g in batch] == [1]  # type: ignore[union-attr]
            assert rollouts.stats().carried_over == 1
        await _until(
            lambda: servers.stats("slow_env").cancelled == 2, "the slow handlers cancelled by the close"
        )


async def test_pause_drain_with_a_deadline_aborts_what_is_left_and_counts_it(ray_session: Any) -> None:
    rows = [_row(i) for i in range(6)]
    async with serve_config(_config(fast_ms=60_000)) as servers:
        async with stream(rows, config=servers.config, num_workers=2, max_in_flight=4) as rollouts:
            await _until(lambda: servers.stats("fast_env").in_flight == 4, "4 handlers running")
            started = asyncio.get_running_loop().time()
            aborted = await rollouts.pause("drain", timeout_s=1.0)
            waited = asyncio.get_running_loop().time() - started
            assert aborted == 4
            assert rollouts.stats().aborted == 4
            await _until(lambda: servers.stats("fast_env").cancelled == 4, "the 4 handlers cancelled")
            assert servers.stats("fast_env").in_flight == 0
            await _set_latency(servers, "fast_env", 0.0)
            await rollouts.resume()
            items = [item async for item in rollouts]
        counts = servers.stats("fast_env").request_counts
    assert 1.0 <= waited < 10.0  # the deadline, plus the cancellation round trip to the workers
    assert sorted(_key(item) for item in items) == [(t, 0) for t in range(6)]  # type: ignore[arg-type]
    assert sum(counts.values()) == 6 + 4  # each aborted row ran once more, nothing else twice


async def test_a_next_batch_cancelled_by_wait_for_leaves_the_stream_usable(ray_session: Any) -> None:
    # 3 fast groups complete, 1 slow one runs: next_batch(4) takes the 3, waits for the 4th and is cancelled
    # by wait_for. The 3 go back to the buffer; the next call delivers them, and nothing is closed.
    rows = [_row(0), _row(1), _row(2), _row(3, "slow")]
    async with serve_config(_config(slow_ms=60_000)) as servers:
        rollouts = stream(rows, config=servers.config, group_size=2, max_in_flight=8)
        async with rollouts:
            await _until(lambda: rollouts.stats().buffered == 6, "the three fast groups complete")
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(rollouts.next_batch(4), 0.5)
            assert rollouts.stats().buffered == 6
            assert rollouts.stats().delivered == 0
            batch = await rollouts.next_batch(3)
            assert sorted(g.task_index for g in batch) == [0, 1, 2]  # type: ignore[union-attr]
            assert rollouts.stats().delivered == 6
        with pytest.raises(UsageError, match=r"^next_batch: this stream is closed$"):
            await rollouts.next_batch(1)
        with pytest.raises(UsageError, match=r"^resume: this stream is closed$"):
            await rollouts.resume()


_CRASHING_TRAINER = """
import asyncio, json, os, signal, sys
from gym_ray import keys
from gym_ray.streaming.api import stream

config, rows, run_dir, noted = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]

async def main():
    rollouts = stream(rows, config=config, max_in_flight=4, record_dir=run_dir, max_staleness=0)
    with open(noted, "a") as out:
        for n in range(8):
            if n == 4:
                await rollouts.set_policy_version(1)
            row, _ = await anext(rollouts)
            out.write(json.dumps([row[keys.TASK_INDEX], row[keys.ROLLOUT_INDEX]]) + "\\n")
            out.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies mid-stream, rollouts still in flight

asyncio.run(main())
"""


async def test_a_killed_trainer_resumes_with_every_delivered_rollout_recorded_once(
    ray_session: Any, tmp_path: Any
) -> None:
    import json
    import sys

    run_dir, noted = tmp_path / "run", tmp_path / "delivered.jsonl"
    rows = [_row(i) for i in range(14)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address,
    }
    async with serve_config(_config(fast_ms=100)) as servers:
        args = [json.dumps(servers.config), json.dumps(rows), str(run_dir), str(noted)]
        trainer = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CRASHING_TRAINER, *args, env=env
        )
        assert await asyncio.wait_for(trainer.wait(), timeout=300) == -signal.SIGKILL
        first = Counter(tuple(json.loads(line)) for line in noted.read_text().splitlines())
        assert (len(first), set(first.values())) == (8, {1})
        assert _recorded(run_dir) == first
        async with stream(
            rows, config=servers.config, max_in_flight=4, record_dir=run_dir, resume=True
        ) as again:
            second = [_key(item) async for item in again]  # type: ignore[arg-type]
    assert sorted([*first, *second]) == [(t, 0) for t in range(14)]
    assert _recorded(run_dir) == Counter({(t, 0): 1 for t in range(14)})
