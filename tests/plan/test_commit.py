"""Committing planned shards (:mod:`gym_ray.plan._commit`): the files a shard writer would write, byte for
byte; the inputs' bytes synced before the manifest is in place; a plan killed between a shard's inputs and
its manifest resumes to the same run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.errors import RecordError
from gym_ray.plan import _commit
from gym_ray.plan.run_manifest import read_run_manifest
from gym_ray.plan.shards import iter_plan
from gym_ray.record.manifest import ShardManifest
from gym_ray.record.shard_files import shard_paths
from gym_ray.record.writer import ShardWriter


def _rows() -> list[dict[str, Any]]:
    """Varied rows: repeats of a task, unicode, nesting, escapes, numbers json writes as is."""
    out: list[dict[str, Any]] = []
    for task in range(7):
        for rollout in range(3 if task % 2 else 1):
            out.append(
                {
                    "q": f'é ✓ {task} "quoted" \\ \n tab\t',
                    "nested": {"list": [1, 2.5, -0.0, 1e21, None, True], "emoji": "😀"},
                    keys.TASK_INDEX: task,
                    keys.ROLLOUT_INDEX: rollout,
                }
            )
    return out


def _plan(run_dir: Path, run_id: str = "run-a") -> list[str]:
    specs = list(iter_plan(_rows(), run_dir, config_identity="cfg", shard_size=4, run_id=run_id))
    return [spec.shard for spec in specs]


def _folder(run_dir: Path) -> dict[str, Any]:
    """Every file of the run folder but the lock files (a writer's random token) and the run manifest;
    a shard manifest as its fields but the time it was written."""
    out: dict[str, Any] = {}
    for path in sorted(run_dir.iterdir()):
        if not path.is_file() or path.name.endswith(".lock") or path.name == "run_manifest.json":
            continue
        if path.name.endswith(".manifest.json"):
            out[path.name] = ShardManifest.model_validate_json(path.read_bytes()).model_dump(
                exclude={"created_at"}
            )
        else:
            out[path.name] = path.read_bytes()
    return out


def test_a_committed_shard_holds_what_a_shard_writer_writes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shards = _plan(run_dir)
    assert shards == ["00000", "00001", "00002", "00003"]  # tasks 0-1, 2-3, 4-5 (4 rows each), 6 (1 row)
    for label in shards:
        paths = shard_paths(run_dir, label)
        # the oracle: the manifest written by a shard writer (what planning used before) from the same plan
        manifest = ShardManifest.model_validate_json(paths.manifest.read_bytes())
        oracle_dir = tmp_path / f"oracle-{label}"
        with ShardWriter(oracle_dir, label, run_id="run-a", config_identity="cfg") as writer:
            writer.write_manifest(manifest)
        oracle = shard_paths(oracle_dir, label)
        assert paths.manifest.read_bytes() == oracle.manifest.read_bytes()
        assert paths.successes.read_bytes() == b""
        assert paths.failures.read_bytes() == b""
        assert paths.lock.exists()
    lines = b"".join(shard_paths(run_dir, s).materialized_inputs.read_bytes() for s in shards).splitlines()
    assert len(lines) == 13
    assert (
        lines[0]
        == (
            '{"q":"é ✓ 0 \\"quoted\\" \\\\ \\n tab\\t","nested":{"list":[1,2.5,-0.0,1e+21,null,true],'
            '"emoji":"😀"},"_ng_task_index":0,"_ng_rollout_index":0}'
        ).encode()
    )


def test_the_inputs_are_synced_before_the_manifest_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(f"fsync {Path(os.readlink(f'/proc/self/fd/{fd}')).name}")
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append(f"replace {Path(dst).name}")
        real_replace(src, dst)

    monkeypatch.setattr(_commit.os, "fsync", fsync)
    monkeypatch.setattr(_commit.os, "replace", replace)
    run_dir = tmp_path / "run"
    list(iter_plan(_rows()[:1], run_dir, config_identity="cfg", shard_size=4, run_id="run-a"))
    start = events.index("fsync 00000.jsonl")  # the staged inputs, synced before anything is renamed
    assert not [e for e in events[:start] if "rollouts-00000" in e]
    shard_events = events[start + 1 : start + 6]
    assert shard_events[:2] == ["replace rollouts-00000_materialized_inputs.jsonl", "fsync run"]
    assert shard_events[2].startswith("fsync .rollouts-00000.manifest.json.tmp-")
    assert shard_events[3:] == ["replace rollouts-00000.manifest.json", "fsync run"]


def test_a_plan_killed_between_inputs_and_manifest_resumes_to_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = tmp_path / "clean"
    _plan(clean)
    killed = tmp_path / "killed"
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        if Path(dst).name == "rollouts-00001.manifest.json":
            raise OSError(28, "No space left on device", str(dst))  # shard 1's inputs are in place already
        real_replace(src, dst)

    monkeypatch.setattr(_commit.os, "replace", replace)
    with pytest.raises(RecordError, match=r"rollouts-00001\.manifest\.json: No space left on device"):
        _plan(killed)
    assert shard_paths(killed, "00001").materialized_inputs.exists()
    assert not shard_paths(killed, "00001").manifest.exists()
    assert not [p for p in killed.iterdir() if ".tmp-" in p.name]  # the temporary manifest was removed
    monkeypatch.setattr(_commit.os, "replace", real_replace)
    assert _plan(killed, run_id="ignored: the folder's run id is kept") == [
        "00000",
        "00001",
        "00002",
        "00003",
    ]
    resumed, fresh = _folder(killed), _folder(clean)
    # shard 1 was kept as it was (its inputs verified), without a manifest, as before this module
    assert sorted(fresh) == sorted([*resumed, "rollouts-00001.manifest.json"])
    assert [name for name in resumed if resumed[name] != fresh[name]] == []
    run_manifest = read_run_manifest(killed)
    assert run_manifest is not None
    assert run_manifest["run_id"] == "run-a"
    assert run_manifest["num_shards"] == 4
    assert run_manifest["planned"] == 13
