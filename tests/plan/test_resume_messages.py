"""Every refusal of resume planning, word for word: one line naming the shard and file, and what to do.

The expected texts are written out by hand; digests come from ``hashlib`` over the file's bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gym_ray.errors import ConfigError, ResumeError
from gym_ray.plan.resume import plan_resume, verify_recorded_inputs
from gym_ray.record.jsonl import encode_line
from gym_ray.record.shard_files import shard_paths
from tests.plan.test_resume import record_shard, row


@dataclass(frozen=True)
class Paths:
    inputs: Path
    manifest: Path
    recorded: str  # the first 12 hex digits of the inputs' digest when recorded


def _short_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def _append_row(run_dir: Path) -> None:
    with shard_paths(run_dir, "s0").materialized_inputs.open("ab") as handle:
        handle.write(encode_line(row(0, 2)))


def _replace_inputs(data: bytes) -> Callable[[Path], None]:
    def write(run_dir: Path) -> None:
        shard_paths(run_dir, "s0").manifest.unlink()
        shard_paths(run_dir, "s0").materialized_inputs.write_bytes(data)

    return write


def _rename_shard_in_manifest(run_dir: Path) -> None:
    manifest = shard_paths(run_dir, "s0").manifest
    manifest.write_text(manifest.read_text().replace('"shard": "s0"', '"shard": "s9"'))


def _unlink(*names: str) -> Callable[[Path], None]:
    def unlink(run_dir: Path) -> None:
        paths = shard_paths(run_dir, "s0")
        for name in names:
            getattr(paths, name).unlink()

    return unlink


_TAMPERED = (
    "shard 's0': materialized inputs {inputs} do not match the manifest (sha256 {recorded}... recorded, "
    "{now}... now); the rows changed after the shard was recorded, so its results may belong to other "
    "rows. Restore the original inputs, or record the shard again in a new run folder"
)

# (damage to the recorded shard, plan_resume's keyword arguments, the exact message)
CASES: dict[str, tuple[Callable[[Path], None], dict[str, Any], str]] = {
    "inputs-changed": (_append_row, {}, _TAMPERED),
    "config-changed": (
        lambda run_dir: None,
        {"config_identity": "cfg-b-0123456789abcdef"},
        "shard 's0' was recorded under config identity cfg-a-012345... but the current config has "
        "cfg-b-012345...; resuming would mix results of two configs. Restore the original config "
        "(servers, routing), or record into a new run folder",
    ),
    "inputs-missing-with-outputs": (
        _unlink("materialized_inputs"),
        {},
        "shard 's0' has recorded outputs but its materialized inputs {inputs} are missing; resume needs "
        "the exact rows the shard was recorded from. Restore that file, or record the shard again in a new "
        "run folder",
    ),
    "never-started": (
        _unlink("materialized_inputs", "successes", "failures"),
        {},
        "shard 's0' has no materialized inputs at {inputs} and nothing recorded: it was never started. "
        "Write its inputs (ShardWriter.write_materialized_inputs) before planning a resume",
    ),
    "gap-in-numbering": (
        _replace_inputs(encode_line(row(0, 0)) + encode_line(row(0, 2))),
        {},
        "{inputs}:2: task 0 has rollout 2 where rollout 1 was expected; collection numbers each task's "
        "rollouts 0, 1, ... in input order, so these are other materialized inputs than collection writes "
        "and shard 's0' cannot be resumed from them. Preprocess the source rows again into a new run folder",
    ),
    "corrupt-inputs-line": (
        _replace_inputs(encode_line(row(0, 0)) + b"{broken\n"),
        {},
        "shard 's0': {inputs}:2: not a JSON object ('{{broken'); fix or remove this line; the inputs file "
        "is written atomically, so it was edited or damaged. Restore it, or record the shard again in a "
        "new run folder",
    ),
    "row-without-identity": (
        _replace_inputs(encode_line({"_ng_task_index": 3, "_ng_rollout_index": "0"})),
        {},
        "{inputs}:1: row has no integer _ng_task_index/_ng_rollout_index (got 3, '0'); shard 's0' has no "
        "rollout identities to resume by. Record it again from preprocessed rows",
    ),
    "manifest-of-another-shard": (
        _rename_shard_in_manifest,
        {},
        "shard 's0': its manifest names shard 's9'; the file was copied from another shard. Restore the "
        "right manifest, or remove it to resume without verification",
    ),
    "no-manifest-required": (
        _unlink("manifest"),
        {"require_config_identity": True},
        "shard 's0' has no manifest, so nothing proves its results came from the current config or "
        "inputs; record it again in a new run folder, or resume without require_config_identity to trust "
        "the files as they are",
    ),
}


def _record(run_dir: Path, config_identity: str | None = "cfg-a-0123456789abcdef") -> Paths:
    record_shard(run_dir, [row(0, 0), row(0, 1)], [row(0, 0, reward=1.0)], config_identity=config_identity)
    paths = shard_paths(run_dir, "s0")
    return Paths(paths.materialized_inputs, paths.manifest, _short_digest(paths.materialized_inputs))


@pytest.mark.parametrize(("damage", "kwargs", "message"), list(CASES.values()), ids=list(CASES))
def test_each_resume_refusal_is_its_exact_message(
    tmp_path: Path, damage: Callable[[Path], None], kwargs: dict[str, Any], message: str
) -> None:
    paths = _record(tmp_path)
    damage(tmp_path)
    now = _short_digest(paths.inputs) if paths.inputs.exists() else ""
    with pytest.raises(ResumeError) as caught:
        plan_resume(tmp_path, "s0", **{"config_identity": "cfg-a-0123456789abcdef", **kwargs})
    assert str(caught.value) == message.format(inputs=paths.inputs, recorded=paths.recorded, now=now)


def test_a_config_without_identity_is_refused_only_when_required(tmp_path: Path) -> None:
    _record(tmp_path, config_identity=None)
    assert plan_resume(tmp_path, "s0", config_identity="cfg-b").pending_count == 1
    with pytest.raises(ResumeError) as caught:
        plan_resume(tmp_path, "s0", config_identity="cfg-b", require_config_identity=True)
    assert str(caught.value) == (
        "shard 's0' was recorded under a config gym_ray could not identify, so its manifest verifies its "
        "own inputs only and cannot show the current config is the same; resume without "
        "require_config_identity to accept that, or record the shard again"
    )


def test_a_damaged_manifest_names_the_shard_and_file(tmp_path: Path) -> None:
    paths = _record(tmp_path)
    paths.manifest.write_text("{not json")
    with pytest.raises(ResumeError) as caught:
        plan_resume(tmp_path, "s0")
    assert str(caught.value) == (
        f"shard 's0': {paths.manifest}: not a valid shard manifest (<body>: Invalid JSON: key must be a "
        "string at line 1 column 2); restore it, or remove it to resume without verifying the inputs"
    )


def test_inputs_edited_after_planning_are_refused_when_read(tmp_path: Path) -> None:
    paths = _record(tmp_path)
    plan = plan_resume(tmp_path, "s0")
    _append_row(tmp_path)
    with pytest.raises(ResumeError) as caught:
        next(plan.iter_pending())
    assert str(caught.value) == (
        f"shard 's0': {paths.inputs} changed after the resume plan was made; plan the resume again"
    )


def test_verify_recorded_inputs_names_shard_file_and_both_digests(tmp_path: Path) -> None:
    paths = _record(tmp_path)
    assert verify_recorded_inputs(tmp_path) == 1
    _append_row(tmp_path)
    with pytest.raises(ResumeError) as caught:
        verify_recorded_inputs(tmp_path)
    assert str(caught.value) == (
        f"shard 's0': materialized inputs {paths.inputs} do not match the manifest (sha256 "
        f"{paths.recorded}... recorded, {_short_digest(paths.inputs)}... now): the file was changed or "
        "damaged after planning, and nothing was sent. Restore it (for example from the input file), or "
        "pass a new output_dir"
    )


@pytest.mark.parametrize("cap", [0, -1, 2.0, True, "3"])
def test_a_bad_attempt_cap_is_a_config_error_naming_the_key(tmp_path: Path, cap: object) -> None:
    with pytest.raises(ConfigError) as caught:
        plan_resume(tmp_path, "s0", max_rollout_attempts=cap)  # type: ignore[arg-type]
    assert str(caught.value) == f"max_rollout_attempts={cap!r} must be an integer >= 1 (default 3)"
    assert caught.value.key == "max_rollout_attempts"
