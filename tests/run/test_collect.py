"""Single-process collection of a whole config: plan, run, resume, finalize (real servers, real files)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray.config.run_config import resolve_run_config
from gym_ray.errors import NoProgressError, ResumeError, ValidationError
from gym_ray.plan.run_manifest import RUN_MANIFEST
from gym_ray.plan.shards import prepare_run
from gym_ray.record.ledger import check_run
from gym_ray.run.collect import acollect_local
from gym_ray.servers import Deployment, serve_config


def _config(*, latency_ms: int = 0, faults: dict[str, Any] | None = None) -> dict[str, Any]:
    env: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "seed": 3,
        "latency_ms": latency_ms,
        "latency_jitter_ms": 0,
        "agent_server": {"type": "responses_api_agents", "name": "calc_agent"},
    }
    if faults:
        env["faults"] = faults
    return {
        "head_server": {"host": "127.0.0.1", "port": 0},
        "calc_agent": {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 0}}},
        "calc_env": {"environment_servers": {"example_env": env}},
    }


def _rows(n: int, *, agent: str = "calc_agent") -> list[dict[str, Any]]:
    return [
        {
            "responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 1?"}]},
            "expected_answer": str(i + 1),
            "difficulty": 0.5,
            "agent_ref": {"name": agent},
        }
        for i in range(n)
    ]


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
async def deployment() -> AsyncIterator[Deployment]:
    async with serve_config(_config(latency_ms=2)) as dep:
        yield dep


def _identities(path: Path) -> list[tuple[int, int]]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows]


async def test_collect_records_every_rollout_once_and_aggregates_once_per_server(
    deployment: Deployment, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    result = await acollect_local(
        deployment.config, rows=_rows(30), output_dir=str(out), num_repeats=3, shard_size=20
    )
    assert (result.planned, result.succeeded, result.failed, result.dispatched) == (90, 90, 0, 90)
    assert _identities(out / "rollouts.jsonl") == [(t, r) for t in range(30) for r in range(3)]
    # shards are cut at task boundaries: 21, 21, 21, 21, 6 rows
    assert sorted(p.name for p in out.glob("rollouts-*_materialized_inputs.jsonl")) == [
        f"rollouts-0000{i}_materialized_inputs.jsonl" for i in range(5)
    ]
    assert deployment.stats("calc_env").aggregate_calls == 1
    assert deployment.stats("calc_env").requests == 90
    metrics = json.loads((out / "rollouts_aggregate_metrics.json").read_text())
    assert [(e["agent_ref"], e["_ng_environment_server"]) for e in metrics] == [
        ({"name": "calc_agent"}, "calc_env")
    ]
    summary = json.loads((out / "rollouts_summary.json").read_text())
    assert (summary["planned"], summary["succeeded"]) == (90, 90)
    # the server sleeps 2 ms per /run: every latency figure is at least that, and ordered
    figures = summary["latency_ms"]
    assert 2.0 <= figures["p50"] <= figures["p99"]
    assert figures["mean"] >= 2.0
    report = check_run(out)
    assert (report.lost, report.missing, report.duplicates, report.corrupt_lines) == (0, 0, 0, 0)


async def test_rerun_on_a_finished_folder_dispatches_nothing(deployment: Deployment, tmp_path: Path) -> None:
    out = str(tmp_path / "run")
    first = await acollect_local(deployment.config, rows=_rows(10), output_dir=out, num_repeats=2)
    deployment.reset_stats()
    second = await acollect_local(deployment.config, rows=_rows(10), output_dir=out, num_repeats=2)
    assert second.run_id == first.run_id
    assert (second.dispatched, second.already_done, second.succeeded) == (0, 20, 20)
    assert deployment.stats("calc_env").requests == 0


async def test_bad_rows_are_refused_before_anything_is_written_or_sent(
    deployment: Deployment, tmp_path: Path
) -> None:
    rows = _rows(5)
    rows[3]["agent_ref"] = {"name": "calc_agnet"}
    out = tmp_path / "run"
    with pytest.raises(
        ValidationError,
        match=r"(?s)'calc_agnet' is not in the running config \(did you mean 'calc_agent'\?\) \[row 3 ",
    ):
        await acollect_local(deployment.config, rows=rows, output_dir=str(out))
    assert deployment.stats("calc_env").requests == 0
    assert not out.exists() or list(out.iterdir()) == []


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


async def test_changed_inputs_are_refused_on_resume(deployment: Deployment, tmp_path: Path) -> None:
    out = str(tmp_path / "run")
    await acollect_local(deployment.config, rows=_rows(6), output_dir=out, shard_size=100)
    changed = _rows(6)
    changed[2]["expected_answer"] = "999"
    deployment.reset_stats()
    before = _files(Path(out))
    expected = (
        r"the run was planned from 6 rows \(sha256 [0-9a-f]{12}\.\.\.\); the 6 rows given now "
        r"\(sha256 [0-9a-f]{12}\.\.\.\) differ; resume with the same input"
    )
    with pytest.raises(ResumeError, match=expected):
        await acollect_local(deployment.config, rows=changed, output_dir=out, shard_size=100)
    assert deployment.stats("calc_env").requests == 0
    assert _files(Path(out)) == before  # refused: nothing written
    # planning's own check (each shard's inputs against the new cut) still stands behind it
    run = await resolve_run_config(deployment.config, settings={"output_dir": out, "shard_size": 100})
    with pytest.raises(ResumeError, match=r"shard 00000 of .* was planned from other inputs"):
        prepare_run(run, rows=changed)


async def test_changed_config_is_refused_on_resume(deployment: Deployment, tmp_path: Path) -> None:
    out = str(tmp_path / "run")
    # Without head_server: with one, the running head's config is the truth and a local change conflicts.
    local = {k: v for k, v in deployment.config.items() if k != "head_server"}
    await acollect_local(local, rows=_rows(4), output_dir=out)
    other = copy.deepcopy(local)
    other["calc_env"]["environment_servers"]["example_env"]["seed"] = 99
    with pytest.raises(ResumeError, match="was collected with another configuration"):
        await acollect_local(other, rows=_rows(4), output_dir=out)


async def test_server_that_never_answers_fails_the_run_with_no_progress(tmp_path: Path) -> None:
    async with serve_config(_config(faults={"hang_rate": 1.0})) as dep:
        started = time.monotonic()
        with pytest.raises(NoProgressError, match=r"no rollout finished for 1 s while 4 were in flight"):
            await acollect_local(
                dep.config,
                rows=_rows(4),
                output_dir=str(tmp_path / "run"),
                no_progress_timeout_s=1.0,
            )
        assert time.monotonic() - started < 30
        # the servers see the cancelled requests' disconnects: every hanging handler ends, and each of the
        # 4 rows was sent exactly once
        for _ in range(600):  # up to 30 s
            if dep.stats("calc_env").in_flight == 0:
                break
            await asyncio.sleep(0.05)
        stats = dep.stats("calc_env")
        assert (stats.in_flight, stats.cancelled) == (0, 4)
        assert stats.request_counts == {(task, 0): 1 for task in range(4)}


_CHILD = """
import asyncio, json, sys
from gym_ray.run.collect import acollect_local
cfg = json.loads(open(sys.argv[1]).read())
asyncio.run(acollect_local(cfg, output_dir=sys.argv[2], input_jsonl_fpath=sys.argv[3],
                           num_repeats=2, shard_size=50, max_resident_tasks=8))
"""


def _recorded(out: Path) -> set[tuple[int, int]]:
    found: set[tuple[int, int]] = set()
    for path in out.glob("rollouts-*.jsonl"):
        if path.name.endswith(("_failures.jsonl", "_materialized_inputs.jsonl")):
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a torn last line: not acknowledged
            found.add((row["_ng_task_index"], row["_ng_rollout_index"]))
    return found


async def test_kill_9_mid_run_then_resume_loses_nothing_and_reruns_nothing_recorded(tmp_path: Path) -> None:
    async with serve_config(_config(latency_ms=20)) as dep:
        cfg_path = tmp_path / "config.json"
        cfg_path.write_text(json.dumps(dep.config), encoding="utf-8")
        rows_path = _write_rows(tmp_path / "rows.jsonl", _rows(150))
        out = tmp_path / "run"
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _CHILD,
            str(cfg_path),
            str(out),
            str(rows_path),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            for _ in range(1200):  # up to 60 s
                if len(_recorded(out)) >= 60 or child.returncode is not None:
                    break
                await asyncio.sleep(0.05)
            assert child.returncode is None, "the collecting process ended before it could be killed"
            os.kill(child.pid, signal.SIGKILL)
        finally:
            await asyncio.wait_for(child.wait(), 30)
        before = _recorded(out)
        assert 60 <= len(before) < 300
        assert (out / RUN_MANIFEST).exists()

        result = await acollect_local(
            dep.config, output_dir=str(out), input_jsonl_fpath=str(rows_path), num_repeats=2, shard_size=50
        )
        assert (result.planned, result.succeeded) == (300, 300)
        assert result.already_done >= len(before)
        counts = dep.stats("calc_env").request_counts
        assert {identity: counts[identity] for identity in before} == dict.fromkeys(before, 1)
        report = check_run(out, acknowledged=before)
        assert (report.lost, report.missing, report.duplicates, report.unexpected) == (0, 0, 0, 0)


async def test_a_config_naming_only_the_head_server_collects_from_the_running_deployment(
    deployment: Deployment, tmp_path: Path
) -> None:
    head = deployment.config["head_server"]
    result = await acollect_local(
        {"head_server": head}, rows=_rows(5), output_dir=str(tmp_path / "run"), num_repeats=2
    )
    assert (result.planned, result.succeeded) == (10, 10)
    assert deployment.stats("calc_env").requests == 10
