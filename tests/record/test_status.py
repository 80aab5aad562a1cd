"""Tests for gym_ray.record.status: run_status / format_status on crafted run folders, and the two CLI
commands."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_ray import cli
from gym_ray.errors import UsageError
from gym_ray.record.manifest import build_manifest
from gym_ray.record.run_lock import RunLock
from gym_ray.record.status import format_status, run_status
from gym_ray.servers import start_in_thread


def _write_lines(path: Path, rows: list[dict[str, Any]], tail: bytes = b"") -> None:
    data = b"".join(json.dumps(row).encode() + b"\n" for row in rows) + tail
    path.write_bytes(data)


def _row(task: int, rollout: int, **extra: Any) -> dict[str, Any]:
    return {"_ng_task_index": task, "_ng_rollout_index": rollout, **extra}


def _failure(task: int, rollout: int, cls: str, **extra: Any) -> dict[str, Any]:
    return _row(task, rollout, _ng_failure_class=cls, **extra)


def _success(task: int, rollout: int, server: str = "env_a") -> dict[str, Any]:
    row = _row(
        task,
        rollout,
        reward=1.0 if rollout == 0 else 0.0,
        _ng_environment_server=server,
        response={"output": [], "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}},
    )
    if server == "env_a":
        row["agent_ref"] = {"name": "ag1"}
    return row


def _shard(
    run_dir: Path,
    shard: str,
    *,
    inputs: list[dict[str, Any]] | None,
    successes: list[dict[str, Any]],
    failures: list[dict[str, Any]] = (),  # type: ignore[assignment]
    created_at: float | None = None,
    updated_at: float | None = None,
    success_tail: bytes = b"",
) -> None:
    stem = run_dir / f"rollouts-{shard}"
    if inputs is not None:
        _write_lines(Path(f"{stem}_materialized_inputs.jsonl"), inputs)
        if created_at is not None:
            manifest = build_manifest(
                run_dir, shard, run_id="run-1", config_identity=None, clock=lambda: created_at
            )
            Path(f"{stem}.manifest.json").write_text(manifest.model_dump_json(indent=2))
    _write_lines(Path(f"{stem}.jsonl"), successes, success_tail)
    if failures:
        _write_lines(Path(f"{stem}_failures.jsonl"), list(failures))
    if updated_at is not None:
        progress = {
            "run_id": "run-1",
            "shard": shard,
            "planned": len(inputs or []),
            "succeeded": len(successes),
            "failed": {},
            "terminal_failed": 0,
            "omitted": 0,
            "attempts": len(successes) + sum(1 for f in failures if not f.get("_ng_no_persist")),
            "updated_at": updated_at,
        }
        Path(f"{stem}.progress.json").write_text(json.dumps(progress))


def _craft_partial_run(run_dir: Path) -> None:
    run_dir.mkdir()
    _shard(
        run_dir,
        "s0",
        inputs=[_row(0, 0), _row(0, 1), _row(1, 0), _row(1, 1)],
        successes=[_success(0, 0), _success(0, 1)],
        failures=[
            _failure(1, 0, "agent_run_error"),
            _failure(1, 0, "agent_run_error", _ng_attempt_index=1),
            _failure(1, 1, "agent_request_failed"),
            _failure(1, 0, "agent_run_error", _ng_attempt_index=2),
        ],
        created_at=1000.0,
        updated_at=1020.0,
    )
    _shard(
        run_dir,
        "s1",
        inputs=[_row(2, 0), _row(2, 1), _row(2, 2)],
        successes=[_success(2, 0)],
        failures=[
            _failure(2, 1, "timeout_exceeded", _ng_failure_terminal=True),
            _failure(2, 2, "cancelled", _ng_no_persist=True, _ng_dispatch_drained=True),
        ],
        created_at=1010.0,
        updated_at=1030.0,
        success_tail=b'{"_ng_task_index": 2, "_ng_rollo',
    )
    _shard(run_dir, "s2", inputs=None, successes=[_success(3, 0)])


def test_run_status_counts_a_partial_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _craft_partial_run(run_dir)
    status = run_status(run_dir)
    s0, s1, s2 = status.shards
    assert s0.model_dump() == {
        "shard": "s0",
        "planned": 4,
        "succeeded": 2,
        "failed_attempts": 4,
        "failed_by_class": {"agent_request_failed": 1, "agent_run_error": 3},
        "terminal": 0,
        "maxed_out": 1,
        "pending": 0,
        "retrying": 1,
        "omitted": 0,
        "corrupt_lines": 0,
        "created_at": 1000.0,
        "updated_at": 1020.0,
        "progress_attempts": 6,
        "resume_error": None,
        "failed": 2,
        "resumable": 1,
    }
    assert (s1.planned, s1.succeeded, s1.failed_attempts, s1.terminal, s1.failed, s1.pending, s1.omitted) == (
        3,
        1,
        1,
        1,
        1,
        1,
        1,
    )
    assert s1.corrupt_lines == 1
    assert (s2.planned, s2.succeeded, s2.pending, s2.terminal) == (None, 1, None, None)
    assert s2.resume_error is not None
    assert s2.resume_error.startswith("shard 's2' has recorded outputs but its materialized inputs")
    # rows as the run summary counts them: succeeded + failed + pending = planned (s2's row unplannable)
    assert (status.planned, status.succeeded, status.failed, status.pending) == (7, 4, 3, 1)
    assert (status.failed_attempts, status.resumable) == (5, 2)
    assert (status.terminal, status.maxed_out, status.retrying, status.omitted) == (1, 1, 1, 1)
    assert status.started_at == 1000.0
    assert status.updated_at == 1030.0
    # no state file and no lock: the state is unknown, so no rate and no ETA
    assert (status.state, status.stopped_by, status.holder) == ("unknown", None, None)
    assert (status.rate_per_s, status.eta_s) == (None, None)
    assert status.complete is False
    assert (status.merged, status.aggregate_servers, status.aggregate_failed) == (False, None, ())

    assert format_status(status) == "\n".join(
        [
            "state: unknown (no run_state.json: the folder was written by an older gym_ray, a stream's "
            "record_dir or the helper's recording)",
            f"run {run_dir}: 3 shard(s), 4 succeeded, 3 failed, 1 pending of 7 planned rollouts",
            "shard  planned  succeeded  failed  pending  failed_attempts  omitted",
            "s0           4          2       2        0                4        0",
            "s1           3          1       1        1                1        1",
            "s2           -          1       -        -                0        0",
            "total        7          4       3        1                5        1",
            "failures by class: agent_request_failed=1, agent_run_error=3, timeout_exceeded=1",
            "failed rows: 1 terminal, 1 at max_rollout_attempts, 1 with attempts left",
            "resume would run: 2 rollout(s) (1 with earlier failed attempts)",
            "last update: 1970-01-01 00:17:10 UTC",
            "corrupt lines: 1 (not counted above; a resume moves them to <shard file>.quarantine and runs "
            "again the rollouts they held)",
            f"shard s2 cannot be resumed: {s2.resume_error}",
            "merged: not yet",
            "aggregate metrics: not written",
        ]
    )

    # While a process holds the folder's run lock, the run is running: rate and ETA are given. 8 attempts
    # counted by the progress files (s0: 2 successes + 4 failures, s1: 1 + 1; the omitted row and the
    # torn tail are not attempts) between the first manifest (1000) and the last update (1030); the ETA
    # is the 1 pending row (a retry waits for a resume) at that rate.
    with RunLock(run_dir, what="collect"):
        live = run_status(run_dir)
    assert (live.state, live.stopped_by) == ("running", None)
    assert live.holder is not None
    assert live.holder.startswith(f"collect pid {os.getpid()} on host {socket.gethostname()}, started 20")
    assert live.rate_per_s == pytest.approx(8 / 30)
    assert live.eta_s == pytest.approx(1 / (8 / 30))
    text = format_status(live).splitlines()
    assert text[0] == f"state: running ({live.holder})"
    assert "rate: 0.27 attempts/s; ETA 4s" in text


def test_status_of_a_complete_aggregated_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "done"
    run_dir.mkdir()
    _shard(run_dir, "shard-0000", inputs=[_row(0, 0), _row(0, 1)], successes=[_success(0, 1), _success(0, 0)])
    (run_dir / "rollouts.jsonl").write_text("")
    entries = [
        {"agent_ref": {"name": "ag1"}, "_ng_environment_server": "env_a", "agent_metrics": {},
         "key_metrics": {}, "group_level_metrics": []},
        {"agent_ref": {"name": "env_b"}, "_ng_environment_server": "env_b", "agent_metrics": {},
         "key_metrics": {}, "group_level_metrics": [], "aggregation_error": "ServerHTTPError: boom"},
    ]  # fmt: skip
    (run_dir / "rollouts_aggregate_metrics.json").write_text(json.dumps(entries))
    status = run_status(run_dir)
    assert status.complete is True
    assert (status.rate_per_s, status.eta_s, status.updated_at) == (None, None, None)
    assert format_status(status) == "\n".join(
        [
            "state: unknown (no run_state.json: the folder was written by an older gym_ray, a stream's "
            "record_dir or the helper's recording)",
            f"run {run_dir}: 1 shard(s), 2 succeeded, 0 failed, 0 pending of 2 planned rollouts",
            "shard       planned  succeeded  failed  pending  failed_attempts  omitted",
            "shard-0000        2          2       0        0                0        0",
            "total             2          2       0        0                0        0",
            "resume would run: 0 rollout(s) (0 with earlier failed attempts)",
            "merged: rollouts.jsonl",
            "aggregate metrics: 2 server(s); failed: env_b",
        ]
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(False, "run folder {d} does not exist; pass the folder a run wrote", id="missing"),
        pytest.param(
            True,
            "run folder {d} holds no shard files (rollouts-<shard>.*); pass the folder a run wrote",
            id="empty",
        ),
    ],
)
def test_run_status_refuses_a_folder_without_shards(tmp_path: Path, make: bool, message: str) -> None:
    run_dir = tmp_path / "nothing"
    if make:
        run_dir.mkdir()
    with pytest.raises(UsageError) as info:
        run_status(run_dir)
    assert str(info.value) == message.format(d=run_dir)


def test_status_command_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    _craft_partial_run(run_dir)
    assert cli.main(["status", str(run_dir)]) == 0
    assert capsys.readouterr().out == format_status(run_status(run_dir)) + "\n"
    assert cli.main(["status", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(run_status(run_dir).model_dump_json())
    assert cli.main(["status", str(tmp_path / "absent")]) == 2
    assert capsys.readouterr().err == (
        f"gym-ray status: error: run folder {tmp_path / 'absent'} does not exist; "
        "pass the folder a run wrote\n"
    )


def _cli_config(cfg_path: Path, fail_env_b: bool) -> dict[str, Any]:
    env_b: dict[str, Any] = {"host": "127.0.0.1", "port": 0}
    if fail_env_b:
        env_b["faults"] = {"aggregate_error_status": 500}
    cfg = {
        "ag1": {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 0}}},
        "env_a": {
            "environment_servers": {
                "example_env": {
                    "host": "127.0.0.1",
                    "port": 0,
                    "agent_server": {"type": "responses_api_agents", "name": "ag1"},
                }
            }
        },
        "env_b": {"environment_servers": {"example_env": env_b}},
    }
    return cfg


@pytest.mark.parametrize(
    ("fail_env_b", "exit_code"),
    [pytest.param(False, 0, id="all-servers-answer"), pytest.param(True, 1, id="one-server-fails")],
)
def test_aggregate_command_merges_and_prints_key_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fail_env_b: bool, exit_code: int
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _shard(run_dir, "s0", inputs=[_row(0, 0), _row(0, 1)], successes=[_success(0, 1), _success(0, 0)])
    _shard(run_dir, "s1", inputs=[_row(1, 0)], successes=[_success(1, 0, server="env_b")])
    cfg_path = tmp_path / "cfg.yaml"
    with start_in_thread(_cli_config(cfg_path, fail_env_b)) as deployment:
        cfg_path.write_text(yaml.safe_dump(deployment.config))
        code = cli.main(
            ["aggregate", str(run_dir), str(cfg_path), "++env_a.environment_servers.example_env.seed=3"]
        )
        calls = (deployment.stats("env_a").aggregate_calls, deployment.stats("env_b").aggregate_calls)
    captured = capsys.readouterr()
    assert code == exit_code
    assert calls == (1, 1)
    metrics = run_dir / "rollouts_aggregate_metrics.json"
    errors = run_dir / "rollouts_aggregate_metrics.errors.json"
    # A failed aggregate writes its entries beside the metrics file, never in its place.
    assert (metrics.exists(), errors.exists()) == (not fail_env_b, fail_env_b)
    written = json.loads((errors if fail_env_b else metrics).read_text())
    assert [(e["agent_ref"]["name"], e["_ng_environment_server"]) for e in written] == [
        ("ag1", "env_a"),
        ("env_b", "env_b"),
    ]
    assert [
        json.loads(line)["_ng_task_index"] for line in (run_dir / "rollouts.jsonl").read_text().splitlines()
    ] == [0, 0, 1]
    key_a = json.dumps(written[0]["key_metrics"], indent=2)
    expected_b = (
        f"  aggregation failed: {written[1]['aggregation_error']}"
        if fail_env_b
        else json.dumps(written[1]["key_metrics"], indent=2)
    )
    assert captured.out == (
        "merged 2 shard(s): 3 success(es), 0 failure line(s) -> rollouts.jsonl\n"
        "servers: the servers the config given names\n"
        f"\nKey metrics for ag1 (env_a):\n{key_a}\n"
        f"\nKey metrics for env_b (env_b):\n{expected_b}\n" + ("" if fail_env_b else f"\nwrote {metrics}\n")
    )
    assert written[0]["key_metrics"]["mean/reward"] == 0.5
    status = run_status(run_dir)
    if fail_env_b:
        assert captured.err == (
            "gym-ray aggregate: AggregationError: /aggregate_metrics failed for env_b; no "
            f"rollouts_aggregate_metrics.json was written; the failed entries are in {errors}. Start the "
            f"servers the config given names and rerun `gym-ray aggregate {run_dir}`, or pass the config of "
            "the running ones with --use-new-config\n"
        )
        assert (status.aggregate_errors_path, status.aggregate_errors_failed) == (str(errors), ("env_b",))
        assert format_status(status).splitlines()[-2:] == [
            "aggregate metrics: not written",
            f"last aggregate: failed for env_b (no metrics written); its entries are in {errors}",
        ]
    else:
        assert captured.err == ""
        assert (status.aggregate_errors_path, status.aggregate_errors_failed) == (None, ())
        assert format_status(status).splitlines()[-1] == "aggregate metrics: 2 server(s)"


def test_a_successful_aggregate_removes_the_errors_file_of_a_failed_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _shard(run_dir, "s0", inputs=[_row(0, 0)], successes=[_success(0, 0)])
    _shard(run_dir, "s1", inputs=[_row(1, 0)], successes=[_success(1, 0, server="env_b")])
    errors = run_dir / "rollouts_aggregate_metrics.errors.json"
    metrics = run_dir / "rollouts_aggregate_metrics.json"
    codes = []
    first = b""
    for fail_env_b in (False, True, False):
        cfg_path = tmp_path / f"cfg-{len(codes)}.yaml"
        with start_in_thread(_cli_config(cfg_path, fail_env_b)) as deployment:
            cfg_path.write_text(yaml.safe_dump(deployment.config))
            codes.append(cli.main(["aggregate", str(run_dir), str(cfg_path)]))
        written = metrics.read_bytes()
        lines = format_status(run_status(run_dir)).splitlines()
        if fail_env_b:  # the metrics of the first aggregate stay; the status says the last one failed
            assert errors.exists()
            assert written == first
            assert lines[-2:] == [
                "aggregate metrics: 2 server(s)",
                "last aggregate: failed for env_b (the metrics above are older); its entries are in "
                f"{errors}",
            ]
        else:
            first = written
            assert not errors.exists()
            assert lines[-1] == "aggregate metrics: 2 server(s)"
    capsys.readouterr()
    assert codes == [0, 1, 0]
