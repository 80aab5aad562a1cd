"""`gym-ray run` with its run folder on S3 (moto's server on 127.0.0.1), as a user runs it: a subprocess,
the reference servers, a local Ray. The folder is read back with `gym-ray status`, `check_run` and
`gym-ray aggregate`; a run killed with SIGKILL resumes from what the store committed."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import psutil
import pytest

from gym_ray.record.ledger import check_run
from gym_ray.servers import calc_config, calc_rows, start_in_thread
from gym_ray.servers.launch import ThreadedDeployment
from gym_ray.store.objects import ObjectStore
from gym_ray.store.segments import SHARDS_PREFIX, read_head
from tests.run._cli import first_line, free_port, gym_ray, write_rows, write_yaml
from tests.run.test_cli_run import _descendants, _start, _wait_for
from tests.store.conftest import SECRET, Bucket

pytestmark = pytest.mark.timeout(900)  # Ray starts take minutes on a loaded 2-core machine


@pytest.fixture
def servers(slow_servers: ThreadedDeployment) -> ThreadedDeployment:
    """The demo servers, ``arith_env`` answering each /run after 300 ms (tests/run's ``slow_servers``)."""
    return slow_servers


def _args(tmp_path: Path, servers: ThreadedDeployment, url: str, *extra: str) -> list[str]:
    config = write_yaml(tmp_path / "run.yaml", {**servers.config, "max_resident_tasks": 4, "shard_size": 10})
    rows = write_rows(tmp_path / "rows.jsonl", 60)
    return [
        "run",
        str(config),
        f"+input_jsonl_fpath={rows}",
        f"+output_dir={url}",
        "--progress",
        "off",
        *extra,
    ]


def _requests(servers: ThreadedDeployment) -> dict[tuple[int, int], int]:
    return dict(servers.stats("arith_env").request_counts)


def _committed(url: str) -> set[tuple[int, int]]:
    """The (task, rollout) of every success line the store commits, read through the shard heads."""
    store = ObjectStore(url)
    found: set[tuple[int, int]] = set()
    for name in store.listing(SHARDS_PREFIX + "/"):
        if not name.endswith("/head.json"):
            continue
        got = read_head(store, name.split("/")[1])
        assert got is not None
        for segment in got[0].segments:
            data, at = store.get(segment["key"]) or (b"", ""), 0
            for part, length in segment["parts"]:
                if part.endswith(".jsonl") and not part.endswith("_failures.jsonl"):
                    for line in data[0][at : at + length].splitlines():
                        record = json.loads(line)
                        found.add((record["_ng_task_index"], record["_ng_rollout_index"]))
                at += length
    return found


def test_a_run_to_s3_completes_and_status_check_run_and_aggregate_read_it_there(
    tmp_path: Path, servers: ThreadedDeployment, bucket: Bucket
) -> None:
    url = bucket.url("sweeps/r1")
    done = gym_ray(_args(tmp_path, servers, url, "--workers", "2"), cwd=tmp_path, timeout_s=600)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert "60 succeeded, 0 failed, 0 pending of 60 planned rollouts" in done.stdout
    assert f"rollouts:  {url}/rollouts.jsonl" in done.stdout
    assert "environment server  mean/reward" in done.stdout  # the metrics table, from the store run's summary
    rollouts = bucket.read("sweeps/r1/rollouts.jsonl").splitlines()
    keys = [(json.loads(line)["_ng_task_index"], json.loads(line)["_ng_rollout_index"]) for line in rollouts]
    assert keys == sorted(keys) == [(task, 0) for task in range(60)]  # in order, each once
    assert sorted(_requests(servers).values()) == [1] * 60
    objects = bucket.keys("sweeps/r1/")
    for name in ("rollouts_aggregate_metrics.json", "rollouts_summary.json", "run_manifest.json"):
        assert f"sweeps/r1/{name}" in objects
    assert not any(SECRET.encode() in bucket.read(key) for key in objects)  # credentials stay in the SDK
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl", "run.yaml", "stage"]  # no "s3:"
    assert list(bucket.stage_root.rglob("*.jsonl")) == []  # every process removed its local copy

    report = check_run(url, request_counts=_requests(servers))
    assert (report.ok, report.planned, report.settled, report.duplicates, report.run_dir) == (
        True,
        60,
        60,
        0,
        url,
    )
    status = gym_ray(["status", url], cwd=tmp_path, timeout_s=120)
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[1] == (
        f"run {url}: 6 shard(s), 60 succeeded, 0 failed, 0 pending of 60 planned rollouts"
    )
    metrics_before = bucket.client.head_object(
        Bucket=bucket.name, Key="sweeps/r1/rollouts_aggregate_metrics.json"
    )
    again = gym_ray(["aggregate", url], cwd=tmp_path, timeout_s=120)
    assert again.returncode == 0, again.stderr
    assert (
        first_line(again.stdout) == "merged 6 shard(s): 60 success(es), 0 failure line(s) -> rollouts.jsonl"
    )
    metrics_after = bucket.client.head_object(
        Bucket=bucket.name, Key="sweeps/r1/rollouts_aggregate_metrics.json"
    )
    assert metrics_after["LastModified"] >= metrics_before["LastModified"]
    assert json.loads(bucket.read("sweeps/r1/rollouts_aggregate_metrics.json"))


def test_a_run_killed_with_sigkill_resumes_from_the_store_and_sends_only_what_is_missing(
    tmp_path: Path, servers: ThreadedDeployment, bucket: Bucket
) -> None:
    url = bucket.url("r2")
    args = _args(tmp_path, servers, url, "--workers", "1", "+store_publish_every=2")
    proc = _start(args, tmp_path)
    try:
        _wait_for(lambda: len(_committed(url)) >= 8, "8 committed rollouts", proc, timeout_s=300)
    finally:
        for child in [*_descendants(proc.pid), psutil.Process(proc.pid)]:  # the whole tree, Ray included
            try:
                child.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        proc.communicate()
    committed = _committed(url)
    first = _requests(servers)
    status = gym_ray(["status", url], cwd=tmp_path, timeout_s=120)
    assert status.returncode == 0, status.stderr
    assert re.fullmatch(  # the store has no lock to probe: it does not claim "killed" or "running"
        r"state: running or killed \(collect pid \d+ on host \S+, started .+ UTC\): a folder on an object "
        r"store has no lock to tell; the records are as of each shard's last publication",
        first_line(status.stdout),
    ), status.stdout
    assert len(first) >= len(committed)
    _rerun_sends_only_the_rest(args, tmp_path, servers, url, committed)


def _rerun_sends_only_the_rest(
    args: list[str], tmp_path: Path, servers: ThreadedDeployment, url: str, committed: set[tuple[int, int]]
) -> None:
    """The same command again: what the store committed is kept, the rest is sent once, the ledger clean."""
    servers.reset_stats()
    rerun = gym_ray(args, cwd=tmp_path, timeout_s=600)
    assert (rerun.returncode, rerun.stderr) == (0, ""), rerun.stderr
    assert (
        f"60 succeeded, 0 failed, 0 pending of 60 planned rollouts (0 failed attempts; {len(committed)} "
        f"already on disk, {60 - len(committed)} dispatched)" in rerun.stdout
    )
    second = _requests(servers)
    assert set(second).isdisjoint(committed)  # nothing the store holds was sent again
    assert set(second) | committed == {(task, 0) for task in range(60)}
    assert sorted(second.values()) == [1] * (60 - len(committed))
    report = check_run(url)
    assert (report.ok, report.planned, report.settled, report.duplicates) == (True, 60, 60, 0)


def test_an_unreachable_store_is_one_line_before_anything_is_sent(
    tmp_path: Path, servers: ThreadedDeployment, bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    done = gym_ray(_args(tmp_path, servers, bucket.url("r3")), cwd=tmp_path, timeout_s=300)
    assert (done.returncode, done.stdout) == (1, "")
    url = bucket.url("r3")
    assert done.stderr == (
        f"gym-ray run: StoreError: {url}: listing the bucket failed: Could not connect to the endpoint URL: "
        f'"http://127.0.0.1:{port}/{bucket.name}?list-type=2&prefix=r3%2F&max-keys=1&encoding-type=url" '
        f"(check AWS_ENDPOINT_URL); rerun the same command once {url} can be reached: it runs only what is "
        "missing\n"
    )
    assert _requests(servers) == {}


def test_a_local_run_writes_to_s3_too(tmp_path: Path, bucket: Bucket) -> None:
    # `gym-ray run --local` (no Ray): planned, run and merged in one process, everything on the store
    with start_in_thread(calc_config(seed=3, latency_ms=0, latency_jitter_ms=0)) as deployment:
        config = write_yaml(tmp_path / "run.yaml", deployment.config)
        _local_run(tmp_path, config, bucket)


def _local_run(tmp_path: Path, config: Path, bucket: Bucket) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in calc_rows(12)))
    url = bucket.url("local")
    args = ["run", str(config), f"+input_jsonl_fpath={rows}", f"+output_dir={url}", "--local"]
    args += ["--progress", "off"]
    done = gym_ray(args, cwd=tmp_path, timeout_s=300)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert f"summary:   {url}/rollouts_summary.json" in done.stdout
    assert "environment server  mean/reward" in done.stdout  # the metrics object read back from the store
    assert len(bucket.read("local/rollouts.jsonl").splitlines()) == 12
    report = check_run(url)
    assert (report.ok, report.planned, report.settled) == (True, 12, 12)
    again = gym_ray(args, cwd=tmp_path, timeout_s=300)  # a rerun finds everything on the store
    assert "12 already on disk, 0 dispatched" in again.stdout, again.stdout + again.stderr


def test_sigterm_publishes_what_was_recorded_and_the_rerun_sends_only_the_rest(
    tmp_path: Path, servers: ThreadedDeployment, bucket: Bucket
) -> None:
    # one 60-row shard, publications every 1000 records: only the stop's own publication commits anything
    url = bucket.url("r4")
    args = _args(tmp_path, servers, url, "--workers", "1", "++shard_size=60")
    proc = _start(args, tmp_path)
    try:
        _wait_for(lambda: len(_requests(servers)) >= 12, "12 requests", proc, timeout_s=300)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert (proc.returncode, stderr) == (
        143,
        f"gym-ray run: stopped by SIGTERM; the run folder {url} is resumable: rerun the same command to run "
        "only what is missing\n",
    )
    committed = _committed(url)
    assert len(committed) >= 8  # recorded before the stop, published by it
    _rerun_sends_only_the_rest(args, tmp_path, servers, url, committed)
