"""The run folder records what ran (``gym_ray_run.json``), and the folder is checked against the command
before anything is locked, written or started.

Real processes: ``gym-ray run`` / ``gym-ray aggregate`` subprocesses against reference servers on
127.0.0.1, and a config file rewritten as a second ``gym-ray serve`` rewrites ``gym-ray-run.yaml`` (with
``write_run_config``, the function ``serve`` uses, pointing at a second deployment on new ports):

- ``aggregate RUN`` keeps talking to the servers the run recorded; given the rewritten config it says
  which servers moved and refuses (exit 2) unless ``--use-new-config``;
- a refused resume (servers moved, another input, another plan setting, ``resume_from_cache=false``,
  another config identity) exits 2 with one line, sends nothing, and leaves every file of the folder
  byte for byte (the lock file included); ``--use-new-config`` resumes against the new servers;
- on Ray (no ``--local``), the refusal comes before Ray starts;
- the record holds the topology, the settings and the input's identity, with secrets redacted.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.record.status import run_status
from gym_ray.run.collect import acollect_local
from gym_ray.servers import Deployment, calc_config, calc_rows, start_in_thread
from gym_ray.servers.launch import ThreadedDeployment, write_run_config
from tests.run._cli import gym_ray, ray_sessions, short_tmp

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def first() -> Iterator[ThreadedDeployment]:
    with start_in_thread(calc_config(seed=3, latency_ms=0, latency_jitter_ms=0)) as deployment:
        yield deployment


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file of the folder (hidden ones included) -> its SHA-256."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _run(config: Path, rows: Path, out: Path, *extra: str, local: bool = True) -> list[str]:
    tail = ["--local", "--progress", "off"] if local else ["--progress", "off"]
    return ["run", str(config), f"+input_jsonl_fpath={rows}", f"+output_dir={out}", *extra, *tail]


def _head_urls(servers: ThreadedDeployment) -> tuple[str, str, str]:
    return (servers.head_url, servers.url_of("calc_agent"), servers.url_of("calc_env"))


def _moved(a: ThreadedDeployment, b: ThreadedDeployment) -> str:
    (head_a, agent_a, env_a), (head_b, agent_b, env_b) = _head_urls(a), _head_urls(b)
    return f"head server {head_a} -> {head_b}; calc_agent {agent_a} -> {agent_b}; calc_env {env_a} -> {env_b}"


def test_a_second_serve_does_not_change_what_aggregate_of_an_earlier_run_talks_to(
    tmp_path: Path, first: ThreadedDeployment
) -> None:
    config, out = tmp_path / "gym-ray-run.yaml", tmp_path / "out"
    write_run_config(str(config), first.head_url)
    rows = _write_rows(tmp_path / "rows.jsonl", calc_rows(4))
    ran = gym_ray(_run(config, rows, out), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    with start_in_thread(calc_config(seed=3, latency_ms=0, latency_jitter_ms=0)) as second:
        write_run_config(str(config), second.head_url)  # what a second `gym-ray serve` does to the file
        again = gym_ray(["aggregate", str(out)], cwd=tmp_path)
        assert again.returncode == 0, again.stderr
        assert "servers: the servers recorded in gym_ray_run.json\n" in again.stdout
        calls = (first.stats("calc_env").aggregate_calls, second.stats("calc_env").aggregate_calls)
        assert calls == (2, 0)  # the run's own, then this one: both to the servers the run used

        given = gym_ray(["aggregate", str(out), str(config)], cwd=tmp_path)
        assert given.returncode == 2
        assert given.stderr == (
            f"gym-ray aggregate: error: the config given resolves to other servers than the run in {out} "
            f"recorded (gym_ray_run.json): {_moved(first, second)}; pass --use-new-config to aggregate "
            "against them, or leave the config out to use the recorded servers\n"
        )
        told = gym_ray(["aggregate", str(out), str(config), "--use-new-config"], cwd=tmp_path)
        assert told.returncode == 0, told.stderr
        assert "servers: the servers the config given names (not the recorded ones: --use-new-config)\n" in (
            told.stdout
        )
        assert (first.stats("calc_env").aggregate_calls, second.stats("calc_env").aggregate_calls) == (2, 1)


@pytest.mark.parametrize(
    "case",
    ["servers-moved", "other-input", "other-setting", "resume-from-cache-false", "other-config"],
)
def test_a_refused_resume_leaves_the_folder_byte_identical_and_sends_nothing(
    tmp_path: Path, first: ThreadedDeployment, case: str
) -> None:
    config, out = tmp_path / "gym-ray-run.yaml", tmp_path / "out"
    write_run_config(str(config), first.head_url)
    # an unfinished run: one row failed (a resume would run it again)
    failing = [*calc_rows(3), {**calc_rows(4)[3], "fault": "500", "fault_until_attempt": 1}]
    rows = _write_rows(tmp_path / "rows.jsonl", failing)
    ran = gym_ray(_run(config, rows, out), cwd=tmp_path)
    assert ran.returncode == 3, ran.stderr
    before = _snapshot(out)
    extra = {"other-setting": ["+num_repeats=2"], "resume-from-cache-false": ["+resume_from_cache=false"]}
    if case == "other-input":
        rows = _write_rows(tmp_path / "rows.jsonl", [*failing[:3], calc_rows(5)[4]])
    with contextlib.ExitStack() as stack:
        target = first
        if case in ("servers-moved", "other-config"):  # a second `gym-ray serve`: new ports (other seed)
            seed = 4 if case == "other-config" else 3
            served = calc_config(seed=seed, latency_ms=0, latency_jitter_ms=0)
            target = stack.enter_context(start_in_thread(served))
            write_run_config(str(config), target.head_url)
        first.reset_stats()
        started = time.monotonic()
        refused = gym_ray(_run(config, rows, out, *extra.get(case, [])), cwd=tmp_path)
        took_s = time.monotonic() - started
        sent = (first.stats("calc_env").requests, target.stats("calc_env").requests)
        moved = _moved(first, target)
    assert refused.returncode == 2, refused.stderr
    assert refused.stdout == ""
    assert sent == (0, 0)
    assert _snapshot(out) == before
    where = f"run folder {out} (recorded in gym_ray_run.json)"
    stderr = refused.stderr.rstrip("\n")
    assert "\n" not in stderr
    if case == "servers-moved":
        assert stderr == (
            f"gym-ray run: error: {where} ran against other servers than this config resolves to "
            f"({moved}); pass --use-new-config (Python: use_new_config=True) to resume against the servers "
            "this config names, or pass the config of the recorded ones"
        )
    elif case == "other-input":
        old = hashlib.sha256(_lines(failing)).hexdigest()[:12]
        new = hashlib.sha256(rows.read_bytes()).hexdigest()[:12]
        assert stderr == (
            f"gym-ray run: error: {where}: the run was planned from {rows} ({len(_lines(failing))} bytes, "
            f"sha256 {old}...); the input given now, {rows} ({rows.stat().st_size} bytes, sha256 {new}...), "
            "differs; resume with the same input, or pass a new output_dir"
        )
    elif case == "other-setting":
        assert stderr == (
            f"gym-ray run: error: {where} was planned with other settings (num_repeats: 1 -> 2); resume "
            "with the settings it was planned with, or pass a new output_dir"
        )
    elif case == "resume-from-cache-false":
        assert stderr.startswith(
            f"gym-ray run: error: run folder {out} already holds a run and resume_from_cache is false;"
        )
    else:
        assert stderr.startswith(f"gym-ray run: error: {out} was collected with another configuration (")
    assert took_s < 15.0  # one process start and a few reads: no planning, no dispatch


def _lines(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def test_use_new_config_resumes_against_the_moved_servers_and_records_them(
    tmp_path: Path, first: ThreadedDeployment
) -> None:
    config, out = tmp_path / "gym-ray-run.yaml", tmp_path / "out"
    write_run_config(str(config), first.head_url)
    failing = [*calc_rows(3), {**calc_rows(4)[3], "fault": "500", "fault_until_attempt": 1}]
    rows = _write_rows(tmp_path / "rows.jsonl", failing)
    assert gym_ray(_run(config, rows, out), cwd=tmp_path).returncode == 3
    with start_in_thread(calc_config(seed=3, latency_ms=0, latency_jitter_ms=0)) as second:
        write_run_config(str(config), second.head_url)
        resumed = gym_ray(_run(config, rows, out, "--use-new-config"), cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr
        assert second.stats("calc_env").requests == 1  # only the failed row, on its second attempt
        record = json.loads((out / "gym_ray_run.json").read_text())
        assert record["topology"]["head_url"] == second.head_url
        assert record["topology"]["servers"] == {
            "calc_agent": second.url_of("calc_agent"),
            "calc_env": second.url_of("calc_env"),
        }
    # a row that failed, then succeeded on the resume: status counts what the summary counts
    summary = json.loads((out / "rollouts_summary.json").read_text())
    status = run_status(out)
    assert (status.state, status.finished_complete) == ("finished", True)
    assert (status.succeeded, status.failed, status.pending, status.failed_attempts) == (4, 0, 0, 0)
    assert (summary["succeeded"], summary["failed"], summary["pending"], summary["failure_attempts"]) == (
        4,
        0,
        0,
        0,
    )


@pytest.mark.ray
def test_a_refused_resume_on_ray_is_refused_before_ray_starts(
    tmp_path: Path, first: ThreadedDeployment
) -> None:
    config, out = tmp_path / "gym-ray-run.yaml", tmp_path / "out"
    write_run_config(str(config), first.head_url)
    rows = _write_rows(tmp_path / "rows.jsonl", calc_rows(3))
    assert gym_ray(_run(config, rows, out), cwd=tmp_path).returncode == 0
    before = _snapshot(out)
    ray_tmp = short_tmp()
    with start_in_thread(calc_config(seed=3, latency_ms=0, latency_jitter_ms=0)) as second:
        write_run_config(str(config), second.head_url)
        started = time.monotonic()
        args = _run(config, rows, out, "--workers", "1", local=False)
        refused = gym_ray(args, cwd=tmp_path, ray_tmp=ray_tmp)
        took_s = time.monotonic() - started
    assert refused.returncode == 2
    assert refused.stderr.startswith(
        f"gym-ray run: error: run folder {out} (recorded in gym_ray_run.json) ran against other servers "
    )
    assert ray_sessions(ray_tmp) == []  # Ray never started
    assert _snapshot(out) == before
    assert took_s < 8.0  # Ray's start alone took 8-16 s before the mismatch was found


async def test_the_record_holds_the_topology_settings_and_input_without_secrets(
    tmp_path: Path, deployment: Deployment
) -> None:
    secret = "sk-run-record-0123456789"
    local = {k: copy.deepcopy(v) for k, v in deployment.config.items() if k != "head_server"}
    local["calc_env"]["environment_servers"]["example_env"]["api_key"] = secret
    rows = _write_rows(tmp_path / "rows.jsonl", calc_rows(3))
    out = tmp_path / "out"
    result = await acollect_local(
        local,
        output_dir=str(out),
        input_jsonl_fpath=str(rows),
        num_repeats=2,
        responses_create_params={"metadata": {"access_token": secret}},
    )
    assert result.complete
    record = json.loads((out / "gym_ray_run.json").read_text())
    assert record["format_version"] == 2
    assert record["input"] == {
        "kind": "file",
        "path": str(rows),
        "size": rows.stat().st_size,
        "sha256": hashlib.sha256(rows.read_bytes()).hexdigest(),
    }
    topology = record["topology"]
    assert (topology["head_url"], set(topology["servers"])) == (None, {"calc_agent", "calc_env"})
    assert topology["servers"]["calc_env"] == deployment.url_of("calc_env")
    assert topology["routing"] == {
        "mode": "agent",
        "environment_server_routes": {},
        "environment_server_name": None,
        "agent_map": {},
    }
    assert record["settings"]["num_repeats"] == 2
    assert record["settings"]["responses_create_params"] == {"metadata": {"access_token": keys.REDACTED}}
    assert record["config"]["calc_env"]["environment_servers"]["example_env"]["api_key"] == keys.REDACTED
    for path in out.iterdir():  # the run record and the state file hold no secret
        if path.name in ("gym_ray_run.json", "run_state.json"):
            assert secret not in path.read_text()
    state = json.loads((out / "run_state.json").read_text())
    assert (state["state"], state["complete"]) == ("finished", True)
    # the resume of the same command is not refused for the secret the record left out
    again = await acollect_local(
        local,
        output_dir=str(out),
        input_jsonl_fpath=str(rows),
        num_repeats=2,
        responses_create_params={"metadata": {"access_token": secret}},
    )
    assert (again.dispatched, again.already_done) == (0, 6)
