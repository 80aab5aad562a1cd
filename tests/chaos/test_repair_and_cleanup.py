"""R5 mid-shard: garbage lines anywhere in a shard are quarantined on reopen and their rollouts run again;
damaged materialized inputs stop a resume before anything is sent; temp folders of killed runs are swept."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from gym_ray.bench.chaos import temp_leftovers
from gym_ray.config.run_config import resolve_run_config
from gym_ray.errors import ResumeError
from gym_ray.plan.shards import iter_prepare_run
from gym_ray.record.ledger import check_run
from gym_ray.record.status import format_status, run_status
from gym_ray.run.collect import acollect_local
from gym_ray.servers import serve_config
from tests.chaos.test_server_outage import _config, _rows, _until, print_figures


def _read(path: Path) -> bytes:
    return path.read_bytes()


async def test_garbage_lines_mid_shard_are_quarantined_and_their_rollouts_run_again(tmp_path: Path) -> None:
    out = tmp_path / "run"
    async with serve_config(_config(latency_ms=0)) as dep:
        first = await acollect_local(dep.config, rows=_rows(60), output_dir=str(out), shard_size=20)
        assert first.succeeded == 60
        shard = out / "rollouts-00001.jsonl"
        lines = _read(shard).splitlines(keepends=True)
        assert len(lines) == 20
        lost = json.loads(lines[4])
        garbage_a = b'{"_ng_task_index": 25, "result": {"reward": 1.0\x00\xff torn\n'
        garbage_b = b"not json at all\n"
        damaged = [*lines[:4], garbage_a, *lines[5:10], garbage_b, *lines[10:]]
        shard.write_bytes(b"".join(damaged))
        offset_a = sum(len(line) for line in lines[:4])
        offset_b = offset_a + len(garbage_a) + sum(len(line) for line in lines[5:10])

        before = check_run(out)
        assert before.corrupt_lines == 2
        text = format_status(run_status(out))
        assert "0 failed, 1 pending of 60 planned rollouts" in text
        assert (
            "corrupt lines: 2 (not counted above; a resume moves them to <shard file>.quarantine and runs "
            "again the rollouts they held)"
        ) in text

        dep.reset_stats()
        second = await acollect_local(dep.config, rows=_rows(60), output_dir=str(out), shard_size=20)
        requests = dep.stats("calc_env").requests
    after = check_run(out)
    print_figures(
        "R5 mid-shard garbage",
        quarantined=2,
        rerun=second.dispatched,
        requests=requests,
        lost=after.lost,
        missing=after.missing,
        duplicates=after.duplicates,
        corrupt=after.corrupt_lines,
    )
    assert (second.dispatched, second.succeeded, requests) == (1, 60, 1)
    assert (after.lost, after.missing, after.duplicates, after.corrupt_lines) == (0, 0, 0, 0)
    assert after.ok
    quarantined = [
        json.loads(line) for line in (out / "rollouts-00001.jsonl.quarantine").read_text().splitlines()
    ]
    assert [(q["line"], q["offset"], q["length"]) for q in quarantined] == [
        (5, offset_a, len(garbage_a)),
        (11, offset_b, len(garbage_b)),
    ]
    assert quarantined[1]["text"] == "not json at all\n"
    repaired = _read(out / "rollouts-00001.jsonl").splitlines(keepends=True)
    assert repaired[:19] == [*lines[:4], *lines[5:]]  # every record kept, in order, byte for byte
    rerun = json.loads(repaired[19])
    key = ("_ng_task_index", "_ng_rollout_index")
    assert tuple(rerun[k] for k in key) == tuple(lost[k] for k in key)
    assert len((out / "rollouts.jsonl").read_text().splitlines()) == 60
    assert "corrupt lines" not in format_status(run_status(out))


async def test_damaged_materialized_inputs_stop_a_resume_before_anything_is_sent(tmp_path: Path) -> None:
    out = tmp_path / "run"
    async with serve_config(_config(latency_ms=0)) as dep:
        await acollect_local(dep.config, rows=_rows(60), output_dir=str(out), shard_size=20)
        # shard 00000 lost its last 5 results (work to do), shard 00002's inputs were damaged
        first = out / "rollouts-00000.jsonl"
        first.write_bytes(b"".join(first.read_bytes().splitlines(keepends=True)[:15]))
        inputs = out / "rollouts-00002_materialized_inputs.jsonl"
        inputs.write_bytes(inputs.read_bytes().replace(b"What is 41 + 1?", b"What is 41 + 2?"))
        dep.reset_stats()
        expected = (
            r"shard '00002': materialized inputs .*rollouts-00002_materialized_inputs\.jsonl do not match "
            r"the manifest \(sha256 [0-9a-f]{12}\.\.\. recorded, [0-9a-f]{12}\.\.\. now\): the file was "
            r"changed or damaged after planning, and nothing was sent"
        )
        with pytest.raises(ResumeError, match=expected):
            await acollect_local(dep.config, rows=_rows(60), output_dir=str(out), shard_size=20)
        assert dep.stats("calc_env").requests == 0
        # the streaming planner of a distributed run refuses before it yields its first shard
        run = await resolve_run_config(dep.config, settings={"output_dir": str(out), "shard_size": 20})
        with pytest.raises(ResumeError, match=expected):
            next(iter_prepare_run(run, rows=_rows(60)))


async def test_temp_folders_of_killed_runs_are_swept_and_a_successful_run_leaves_none(tmp_path: Path) -> None:
    out = tmp_path / "run"
    async with serve_config(_config(latency_ms=0)) as dep:
        await acollect_local(dep.config, rows=_rows(30), output_dir=str(out), shard_size=10)
        assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".gym_ray_run.lock"]
        # what kills during planning, aggregation, merging and an atomic write leave behind
        for folder in (".staging-0a1b2c3d", ".aggregate-k2j3h4", ".merge-x1y2z3", ".control/5e6f7a8b9c0d"):
            (out / folder).mkdir(parents=True)
            (out / folder / "part.jsonl").write_bytes(b"x" * 1000)
        (out / ".rollouts-00000.progress.json.tmp-0a1b2c3d4e5f").write_bytes(b"{")
        (out / ".user-notes").write_text("mine")
        (out / "notes.txt").write_text("mine")
        second = await acollect_local(dep.config, rows=_rows(30), output_dir=str(out), shard_size=10)
    assert second.dispatched == 0
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [
        ".gym_ray_run.lock",
        ".user-notes",
    ]
    assert (out / "notes.txt").read_text() == "mine"
    assert check_run(out).ok


_CHILD = """
import asyncio, json, sys
from gym_ray.run.collect import acollect_local
cfg, rows, out = json.load(open(sys.argv[1]))
asyncio.run(acollect_local(cfg, rows=rows, output_dir=out, shard_size=25, max_resident_tasks=8))
"""


async def test_sigkill_resume_cycles_leave_no_temp_folder_and_lose_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = tmp_path / "args.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    kills: list[int] = []
    async with serve_config(_config(latency_ms=10)) as dep:
        args.write_text(json.dumps([dep.config, _rows(200), str(out)]))
        for target in (30, 90, 150):  # kill the run at three points, each after more /run calls
            child = await asyncio.create_subprocess_exec(sys.executable, "-c", _CHILD, str(args), env=env)
            try:
                await _until(lambda t=target: dep.stats("calc_env").requests >= t, f"{target} requests")
            finally:
                child.kill()  # SIGKILL: no finally blocks, no cleanup
                await child.wait()
            kills.append(dep.stats("calc_env").requests)
        result = await acollect_local(
            dep.config, rows=_rows(200), output_dir=str(out), shard_size=25, max_resident_tasks=8
        )
        requests = dep.stats("calc_env").requests
    report = check_run(out)
    leftovers = temp_leftovers(out)
    print_figures(
        "kill/resume cycles",
        killed_after_requests=kills,
        requests=requests,
        wasted_requests=requests - 200,
        lost=report.lost,
        missing=report.missing,
        duplicates=report.duplicates,
        leftovers=len(leftovers),
    )
    assert leftovers == []
    assert (result.succeeded, result.failed) == (200, 0)
    assert (report.lost, report.missing, report.duplicates, report.corrupt_lines) == (0, 0, 0, 0)
