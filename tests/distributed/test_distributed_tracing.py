"""Tracing across Ray workers: the job span on the caller's side, one root span per rollout in the worker
processes, each linked to the job span (spans from every process land in one ``file`` exporter JSONL); no
OpenTelemetry in the actors' processes when tracing is off; and the live progress line of
``acollect(progress=True)``."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.config.run_config import resolve_run_config
from gym_ray.distributed.api import acollect, run_actors
from gym_ray.observe.tracing import JOB_SPAN, ROLLOUT_SPAN, setup_tracing_from_config, shutdown_tracing
from gym_ray.servers import ThreadedDeployment, bundled_dataset_path, load_bundled_config, start_in_thread
from tests.distributed.module_notes import (
    finalize_noting_modules,
    plan_noting_modules,
    shard_noting_modules,
)
from tests.summaries import workers_that_dispatched

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

ENVS = ("arith_env", "arith_env_hard")


@pytest.fixture(scope="module")
def servers() -> Iterator[ThreadedDeployment]:
    cfg = load_bundled_config()
    for env in ENVS:
        cfg[env]["environment_servers"]["example_env"].update(latency_ms=10, latency_jitter_ms=0)
    with start_in_thread(cfg) as deployment:
        yield deployment


def _rows(count: int) -> list[dict[str, Any]]:
    lines = bundled_dataset_path().read_text(encoding="utf-8").splitlines()
    rows = []
    for index in range(count):
        row = json.loads(lines[index % len(lines)])
        row["row_number"] = index
        row[keys.AGENT_REF] = {"name": ("arith_agent", "arith_agent_hard")[index % 2]}
        rows.append(row)
    return rows


def _read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


async def test_rollout_spans_from_several_workers_link_to_the_job_span(
    ray_session: Any, servers: ThreadedDeployment, tmp_path: Path
) -> None:
    span_file = tmp_path / "spans.jsonl"
    config = dict(servers.config)
    config["tracing"] = {"enabled": True, "exporter": "file", "file_path": str(span_file)}
    try:
        result = await acollect(
            config,
            rows=_rows(40),
            output_dir=str(tmp_path / "run"),
            num_workers=2,
            shard_size=4,
            max_resident_tasks=4,
            progress=False,
        )
    finally:
        shutdown_tracing(setup_tracing_from_config(config))
    spans = _read_jsonl(span_file)
    jobs = [s for s in spans if s["name"] == JOB_SPAN]
    assert [(j["pid"], j["parent_span_id"], j["attributes"]["gym_ray.run_id"]) for j in jobs] == [
        (os.getpid(), None, result.run_id)
    ]
    job_link = [{"trace_id": jobs[0]["trace_id"], "span_id": jobs[0]["span_id"]}]
    rollouts = [s for s in spans if s["name"] == ROLLOUT_SPAN]
    identities = sorted(
        (s["attributes"]["gym_ray.task_index"], s["attributes"]["gym_ray.rollout_index"]) for s in rollouts
    )
    assert identities == [(task, 0) for task in range(40)]  # exactly one root span per rollout
    assert {s["parent_span_id"] for s in rollouts} == {None}
    assert all(s["links"] == job_link for s in rollouts)
    assert len({s["trace_id"] for s in rollouts}) == 40  # each rollout is its own trace
    worker_pids = {s["pid"] for s in rollouts}
    # One process per worker that sent rollouts (usually both; on a loaded machine one worker can take
    # every shard before the other has started: the hand-out is pull-based), never the caller's.
    assert len(worker_pids) == len(workers_that_dispatched(result.summary_path)) >= 1
    assert os.getpid() not in worker_pids
    assert result.succeeded == 40


async def test_progress_line_shows_absolute_counts_and_mean_reward_by_server(
    ray_session: Any, servers: ThreadedDeployment, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = await acollect(
        servers.config,
        rows=_rows(30),
        output_dir=str(tmp_path),
        num_workers=2,
        shard_size=5,
        num_repeats=2,
        progress=True,
    )
    rewards: dict[str, list[float]] = {}
    for record in _read_jsonl(result.rollouts_path):
        rewards.setdefault(record[keys.ENVIRONMENT_SERVER], []).append(record[keys.REWARD])
    means = " ".join(f"{env} {sum(r) / len(r):.2f}" for env, r in sorted(rewards.items()))
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("60/60 (100.0%) ")
    assert " failed 0 ETA 0s | " in last
    assert last.endswith(f"| {means}")


async def test_each_actor_process_loads_only_its_roles_modules_and_no_opentelemetry(
    ray_session: Any, servers: ThreadedDeployment, tmp_path: Path
) -> None:
    # The default planner, shard and finalize functions, noting what their process has loaded once they
    # are done (from a module of their own: this one imports OpenTelemetry, and the actors import what
    # they call). Tracing is off.
    notes = tmp_path / "notes"
    notes.mkdir()
    run = await resolve_run_config(
        servers.config, settings={"output_dir": str(tmp_path / "run"), "shard_size": 5}
    )
    result = await run_actors(
        run,
        functools.partial(plan_noting_modules, str(notes), run, ray_session.put(_rows(20))),
        run_dir=str(tmp_path / "run"),
        num_workers=2,
        shard_fn=functools.partial(shard_noting_modules, str(notes)),
        finalize_fn=functools.partial(finalize_noting_modules, str(notes)),
    )
    assert result.succeeded == 20
    otel: dict[str, set[str]] = {}
    loaded: dict[str, set[str]] = {}
    for path in notes.iterdir():
        note = json.loads(path.read_text())
        role = path.name.split("-")[0]
        otel.setdefault(role, set()).update(note["opentelemetry"])
        loaded.setdefault(role, set()).update(note["gym_ray"])
    assert otel == {"driver": set(), "worker": set(), "coordinator": set()}
    finishing = {"gym_ray.run.finalize", "gym_ray.finalize.merge", "gym_ray.finalize.aggregate"}
    dispatching = {"gym_ray.dispatch.engine", "gym_ray.record.writer", "gym_ray.distributed.worker"}
    assert loaded["driver"] & (finishing | dispatching) == set()  # plans and hands out, nothing more
    assert loaded["worker"] & finishing == set()  # (it loads driver.py: Ray's handle of the driver does)
    # merges and aggregates (with its own client pool), never dispatches rollouts
    assert (
        loaded["coordinator"] & {"gym_ray.distributed.worker", "gym_ray.distributed.driver", *dispatching}
        == set()
    )
    assert finishing <= loaded["coordinator"]  # the notes are real
    assert dispatching <= loaded["worker"]
