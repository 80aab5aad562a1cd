"""NeMo Gym 0.7 collector options as 0.7 really behaves (issue 31, items 4-7): ``+agent_name``'s agent_ref,
the run's dispatch budget, an explicit ``require_complete=false``, the quality pass
(``disable_health_check=false``), aggregation's files beside ``output_jsonl_fpath``, 0.7's attempt cap
from the environment and ``env.yaml``, the metrics file's bytes, flags between overrides."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.run.collect import acollect_local
from gym_ray.servers import Deployment, calc_config, calc_rows, serve_config

pytestmark = pytest.mark.timeout(60)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
async def calc() -> AsyncIterator[Deployment]:
    async with serve_config(calc_config(seed=3, latency_ms=1, latency_jitter_ms=0)) as dep:
        yield dep


# --- item 4: +agent_name rewrites agent_ref as 0.7 does ------------------------------------------------


async def test_agent_name_writes_exactly_name_for_every_row(calc: Deployment, tmp_path: Path) -> None:
    # 0.7 (rollout_collection.py, _preprocess_rows_from_config): a row agent_map routes gets
    # agent_ref = {"name": X}, also when it named X already with more fields.
    rows = calc_rows(3)
    rows[0][keys.AGENT_REF] = {"type": "responses_api_agents", "name": "calc_agent"}
    rows[1].pop(keys.AGENT_REF)
    out = tmp_path / "r.jsonl"
    await acollect_local(calc.config, rows=rows, output_jsonl_fpath=str(out), agent_name="calc_agent")
    materialized = _lines(tmp_path / "r_materialized_inputs.jsonl")
    assert [r[keys.AGENT_REF] for r in materialized] == [{"name": "calc_agent"}] * 3
    assert sorted(json.dumps(r[keys.AGENT_REF]) for r in _lines(out)) == ['{"name": "calc_agent"}'] * 3


# --- item 6a: dispatch_budget_s is the run's, one deadline for every shard and worker -----------------


async def test_the_dispatch_budget_is_one_deadline_for_every_shard(tmp_path: Path) -> None:
    # 64 rollouts in 16 shards of 4, 2 shards at once sharing 2 slots, 2.5 s per rollout, a 2 s budget
    # without margin, counted from the run's start: each slot starts one rollout (planning takes well under
    # 2 s), and at ~2.5 s the run's budget is spent, so 2 rollouts ran in all. A budget restarted in every
    # shard sent 2 more for every 2 shards (16 over ~20 s).
    async with serve_config(calc_config(seed=3, latency_ms=2500, latency_jitter_ms=0)) as dep:
        result = await acollect_local(
            dep.config,
            rows=calc_rows(64),
            output_dir=str(tmp_path / "run"),
            shard_size=4,
            num_samples_in_parallel=2,
            dispatch_budget_s=2.0,
            drain_margin_s=0,
        )
        assert dep.stats("calc_env").requests == 2
    assert (result.planned, result.succeeded, result.pending) == (64, 2, 62)


@pytest.mark.ray
def test_ray_workers_stop_at_the_runs_deadline(ray_session: Any, tmp_path: Path) -> None:
    # The deadline crosses to the workers as an instant: one already past dispatches nothing anywhere.

    from gym_ray.config.run_config import resolve_run_config
    from gym_ray.distributed.api import collect
    from gym_ray.servers import start_in_thread

    with start_in_thread(calc_config(seed=3, latency_ms=1, latency_jitter_ms=0)) as dep:
        cfg = {
            **dep.config,
            "output_dir": str(tmp_path / "run"),
            "shard_size": 2,
            "dispatch_budget_s": 600,
        }
        run = asyncio.run(resolve_run_config(cfg))
        assert run.dispatch_deadline_unix_s is None
        past = run.with_dispatch_deadline(now_unix_s=time.time() - 601)
        result = collect(past, rows=calc_rows(8), num_workers=2)
        assert dep.stats("calc_env").requests == 0
    assert (result.planned, result.succeeded, result.pending) == (8, 0, 8)


# --- item 6c: an explicit require_complete=false exits 0 with the failures in the summary -------------


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _head_args(dep: Any) -> list[str]:
    host, port = dep.head_url.removeprefix("http://").rsplit(":", 1)
    return [f"+head_server.host={host}", f"+head_server.port={port}"]


@pytest.mark.parametrize(
    ("extra", "status"),
    [
        pytest.param(["+require_complete=false"], 0, id="explicit-false-exits-0"),
        pytest.param([], 3, id="unset-exits-3"),
        pytest.param(["+require_complete=true"], 3, id="true-exits-3"),
    ],
)
def test_an_explicit_require_complete_false_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], status: int
) -> None:
    from gym_ray import cli
    from gym_ray.servers import start_in_thread

    rows = _write_rows(tmp_path / "in.jsonl", calc_rows(3))
    with start_in_thread(calc_config(seed=3, latency_ms=1, faults={"error_rate": 1.0})) as dep:
        argv = [
            "run",
            *_head_args(dep),
            f"+input_jsonl_fpath={rows}",
            f"+output_jsonl_fpath={tmp_path / 'r.jsonl'}",
        ]
        assert cli.main([*argv, *extra, "--local", "--progress", "off"]) == status
    captured = capsys.readouterr()
    summary = ": 0 succeeded, 3 failed, 0 pending of 3 planned rollouts (3 failed attempts;"
    # true raises in finalize_run (as 0.7's check_completion), before the summary is printed
    assert (summary in captured.out) == (extra != ["+require_complete=true"])
    assert ("is incomplete: 3 failed and 0 pending of 3 planned rollouts" in captured.err) == (status == 3)
    assert len(_lines(tmp_path / "r_failures.jsonl")) == 3


# --- item 5: disable_health_check=false, 0.7's quality reports ----------------------------------------

#: 0.7's check registry in its order (nemo_gym/health/checks.py, CHECK_REGISTRY): 3 record checks, 9
#: trajectory checks, 2 task checks.
_RECORD_CHECKS = ["check_execution_error", "record_unreadable", "rollout_duplicate_identity"]
_TRAJECTORY_CHECKS = [
    "rollout_missing_agent_turns",
    "rollout_ended_on_failed_model_call",
    "agent_turn_hollow",
    "model_call_zero_completion_tokens",
    "model_call_missing_token_counts",
    "trajectory_capture_mismatch",
    "model_call_failed",
    "rollout_token_count_mismatch",
    "model_call_runaway_generation",
]
_TASK_CHECKS = ["task_consistently_unhealthy", "task_no_successful_model_calls"]


def _coverage(records: int, tasks: int) -> dict[str, dict[str, int]]:
    """0.7's coverage for ``records`` readable rollouts without trajectory in ``tasks`` tasks of <2 repeats
    with a verdict other than unobserved."""
    out = {c: {"evaluated": records, "unobserved": 0, "ignored": 0} for c in _RECORD_CHECKS}
    out |= {c: {"evaluated": 0, "unobserved": records, "ignored": 0} for c in _TRAJECTORY_CHECKS}
    out |= {c: {"evaluated": 0, "unobserved": tasks, "ignored": 0} for c in _TASK_CHECKS}
    return out


async def test_the_quality_reports_are_written_beside_the_output_as_0_7_writes_them(
    calc: Deployment, tmp_path: Path
) -> None:
    # 0.7's default (disable_health_check unset = false) with output_jsonl_fpath: rollout_health.py,
    # run_health_checks -> _write_reports, into the output's folder.
    out = tmp_path / "r.jsonl"
    await acollect_local(calc.config, rows=calc_rows(2), output_jsonl_fpath=str(out), num_repeats=2)
    summary = json.loads((tmp_path / "quality_summary.json").read_text(encoding="utf-8"))
    tokens = {"prompt": 0, "completion": 0}
    for row in _lines(out):
        usage = row["response"]["usage"]
        tokens["prompt"] += usage["input_tokens"]
        tokens["completion"] += usage["output_tokens"]
    assert tokens == {"prompt": 20, "completion": 16}
    task = {"repeats": 2, "healthy": 0, "unhealthy": 0, "unobserved": 2, "flags": []}
    assert summary == {
        "run": {
            "ignored_checks": [],
            "artifacts": {"records": 4, "captures": 0, "coverage": _coverage(4, 2)},
            "verdicts": {"healthy": 0, "unhealthy": 0, "unobserved": 4},
            "issues": dict.fromkeys(_RECORD_CHECKS + _TRAJECTORY_CHECKS + _TASK_CHECKS, 0),
            "stats": {
                "model_call_errors": {
                    "total": 0,
                    "by_status": {},
                    "rollouts_affected": 0,
                    "ended_on_error": 0,
                },
                "duplicated_calls": {"replayed": 0, "rollouts": 0},
                "tokens": {**tokens, "capture_prompt": 0, "capture_completion": 0},
            },
        },
        "tasks": {"0": task, "1": task},
    }
    text = (tmp_path / "quality_summary.json").read_bytes()
    assert text.startswith(b'{\n  "run": {\n    "ignored_checks": [],\n')
    assert text.endswith(b"\n  }\n}")  # orjson's indent 2, no newline at the end
    unobserved = json.dumps(_TRAJECTORY_CHECKS, separators=(",", ":"))
    assert (tmp_path / "rollout_verdicts.jsonl").read_text(encoding="utf-8") == "".join(
        f'{{"_ng_task_index":{t},"_ng_rollout_index":{r},"rollout_id":"{t}-{r}","verdict":"unobserved",'
        f'"findings":[],"unobserved":{unobserved}}}\n'
        for t in range(2)
        for r in range(2)
    )


def test_unreadable_and_duplicate_rollouts_are_judged_as_0_7_judges_them(tmp_path: Path) -> None:
    from gym_ray.finalize.quality import write_quality_reports

    good = {"_ng_task_index": 0, "_ng_rollout_index": 0, "response": {"usage": {"prompt_tokens": 4}}}
    other = {"_ng_task_index": 0, "_ng_rollout_index": 1, "_ng_rollout_id": "x", "stage_index": 2}
    lines = [json.dumps(good), "", "not json", json.dumps(good), json.dumps(other), json.dumps(other), "[1]"]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    reports = write_quality_reports(path, ignored_checks=("agent_turn_hollow",))
    assert reports.verdicts == {"healthy": 0, "unhealthy": 6, "unobserved": 0}
    verdicts = _lines(tmp_path / "rollout_verdicts.jsonl")
    assert [(v["_ng_task_index"], v["_ng_rollout_index"], v["rollout_id"]) for v in verdicts] == [
        (0, 0, "0-0"),
        (0, 0, "0-0"),
        (0, 1, "x"),
        (0, 1, "x"),
        ("__unreadable_record__:input-0:line-3", 0, "__unreadable_record__:input-0:line-3-0"),
        ("__unreadable_record__:input-0:line-7", 0, "__unreadable_record__:input-0:line-7-0"),
    ]
    assert verdicts[0]["findings"] == [
        {"check": "rollout_duplicate_identity", "detail": {"duplicate_count": 2}}
    ]
    assert verdicts[2]["stage_index"] == 2
    assert verdicts[5]["findings"] == [
        {
            "check": "record_unreadable",
            "locator": {"source_file": str(path), "line": 7},
            "detail": {"reason": "rollout record is unreadable", "error": "ValueError"},
        }
    ]
    assert verdicts[4]["findings"][0]["detail"]["error"] == "JSONDecodeError"
    assert verdicts[4]["unobserved"] == [
        c for c in _RECORD_CHECKS + _TRAJECTORY_CHECKS if c not in ("record_unreadable", "agent_turn_hollow")
    ]
    summary = json.loads((tmp_path / "quality_summary.json").read_text(encoding="utf-8"))
    assert summary["run"]["ignored_checks"] == ["agent_turn_hollow"]
    assert summary["run"]["issues"]["rollout_duplicate_identity"] == 4
    assert summary["run"]["issues"]["task_consistently_unhealthy"] == 1
    assert summary["run"]["stats"]["tokens"]["prompt"] == 8
    assert summary["tasks"]["0"] == {
        "repeats": 2, "healthy": 0, "unhealthy": 2, "unobserved": 0, "flags": ["task_consistently_unhealthy"]
    }  # fmt: skip
    assert summary["run"]["artifacts"]["coverage"]["agent_turn_hollow"] == {
        "evaluated": 0, "unobserved": 0, "ignored": 6
    }  # fmt: skip


@pytest.mark.parametrize(
    ("settings", "where"),
    [
        pytest.param({"disable_health_check": True}, None, id="true-skips"),
        pytest.param({"disable_health_check": False, "disable_aggregation": True}, None, id="no-aggregation"),
        pytest.param({"output_dir": "D"}, None, id="output_dir-default-skips"),
        pytest.param({"output_dir": "D", "disable_health_check": False}, "D", id="output_dir-false-writes"),
    ],
)
async def test_when_the_quality_pass_runs(
    calc: Deployment, tmp_path: Path, settings: dict[str, Any], where: str | None
) -> None:
    if "output_dir" in settings:
        settings = {**settings, "output_dir": str(tmp_path / "D")}
    else:
        settings = {**settings, "output_jsonl_fpath": str(tmp_path / "r.jsonl")}
    await acollect_local(calc.config, rows=calc_rows(1), **settings)
    found = sorted(
        p.relative_to(tmp_path).parent.as_posix() for p in await asyncio.to_thread(_quality_files, tmp_path)
    )
    assert found == ([] if where is None else [where])


def _quality_files(folder: Path) -> list[Path]:
    return list(folder.rglob("quality_summary.json"))


def test_rollouts_with_trajectory_evidence_get_no_report(tmp_path: Path) -> None:
    from gym_ray.finalize.quality import write_quality_reports

    path = tmp_path / "r.jsonl"
    path.write_text(
        json.dumps({"_ng_task_index": 0, "ng_trajectory": {"turns": []}}) + "\n", encoding="utf-8"
    )
    (tmp_path / "quality_summary.json").write_text("{}", encoding="utf-8")  # an earlier run's
    reports = write_quality_reports(path)
    assert (reports.summary_path, reports.verdicts_path) == (None, None)
    assert "NeMo Gym 0.7's trajectory checks are not in gym_ray" in str(reports.skipped_because)
    assert not (tmp_path / "quality_summary.json").exists()


async def test_an_unknown_ignored_check_is_refused() -> None:
    from gym_ray.config.run_config import resolve_run_config
    from gym_ray.errors import ConfigError
    from gym_ray.servers import load_bundled_config

    standalone = load_bundled_config()
    run = await resolve_run_config(
        {**standalone, "health_check_ignored_checks": "agent_turn_hollow, model_call_failed"}
    )
    assert run.settings.health_check_ignored_checks == ("agent_turn_hollow", "model_call_failed")
    with pytest.raises(
        ConfigError, match=r"unknown rollout health check\(s\): agent_turn_holow; the checks are "
    ):
        await resolve_run_config({**standalone, "health_check_ignored_checks": ["agent_turn_holow"]})


# --- item 6d: no stale metrics; the files beside output_jsonl_fpath follow `gym-ray aggregate` --------


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))


def test_disable_aggregation_then_aggregate_keeps_the_files_beside_p_current(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gym_ray import cli
    from gym_ray.servers import start_in_thread

    out = tmp_path / "r.jsonl"
    run_dir = tmp_path / "r_run"
    rows = _write_rows(tmp_path / "in.jsonl", calc_rows(3))
    with start_in_thread(calc_config(seed=3, latency_ms=1, latency_jitter_ms=0)) as dep:
        argv = ["run", *_head_args(dep), f"+input_jsonl_fpath={rows}", f"+output_jsonl_fpath={out}"]
        assert cli.main([*argv, "--local", "--progress", "off"]) == 0
        first = json.loads((tmp_path / "r_aggregate_metrics.json").read_text(encoding="utf-8"))
        # A rerun without aggregation leaves no metrics file of the earlier run, here or in the run folder,
        # and no quality report of the earlier rollouts.
        assert cli.main([*argv, "+disable_aggregation=true", "--local", "--progress", "off"]) == 0
        assert _names(tmp_path) == ["in.jsonl", "r.jsonl", "r_failures.jsonl", "r_materialized_inputs.jsonl"]
        assert "rollouts_aggregate_metrics.json" not in _names(run_dir)
        capsys.readouterr()
        assert cli.main(["aggregate", str(run_dir)]) == 0
    assert f"published under NeMo Gym's names: {out} and the files beside it" in capsys.readouterr().out
    for beside, own in [
        ("r.jsonl", "rollouts.jsonl"),
        ("r_failures.jsonl", "rollouts_failures.jsonl"),
        ("r_aggregate_metrics.json", "rollouts_aggregate_metrics.json"),
    ]:
        assert (tmp_path / beside).read_bytes() == (run_dir / own).read_bytes()
        assert (tmp_path / beside).stat().st_ino == (run_dir / own).stat().st_ino  # a link to the new file
    assert json.loads((tmp_path / "r_aggregate_metrics.json").read_text(encoding="utf-8")) == first
    # The materialized inputs are a file of their own: the shards' inputs concatenated in planned order.
    materialized = tmp_path / "r_materialized_inputs.jsonl"
    assert materialized.stat().st_nlink == 1
    assert materialized.read_bytes() == (run_dir / "rollouts-00000_materialized_inputs.jsonl").read_bytes()


# --- item 6e: NEMO_GYM_MAX_ROLLOUT_ATTEMPTS and env.yaml, as 0.7 reads them ----------------------------


@pytest.mark.parametrize(
    ("variable", "settings", "resent"),
    [
        pytest.param("1", {}, 0, id="one-attempt"),
        pytest.param("2", {}, 3, id="two-attempts"),
        pytest.param("1", {"max_rollout_attempts": 2}, 3, id="the-setting-wins"),
        pytest.param("zero", {}, 3, id="invalid-is-0.7s-default"),
    ],
)
async def test_the_attempt_cap_comes_from_0_7s_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str, settings: dict[str, Any], resent: int
) -> None:
    # rollout_collection.py, get_max_rollout_attempts: unset/empty -> 3; not an int >= 1 -> warning, 3.
    monkeypatch.setenv("NEMO_GYM_MAX_ROLLOUT_ATTEMPTS", variable)
    async with serve_config(calc_config(seed=3, latency_ms=1, faults={"error_rate": 1.0})) as dep:
        out = str(tmp_path / "r.jsonl")
        first = await acollect_local(dep.config, rows=calc_rows(3), output_jsonl_fpath=out, **settings)
        again = await acollect_local(dep.config, rows=calc_rows(3), output_jsonl_fpath=out, **settings)
    assert (first.dispatched, first.failed) == (3, 3)
    assert again.dispatched == resent


def test_env_yaml_is_merged_over_the_config_files_and_under_the_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # global_config.py, GlobalConfigDictParser.parse: config_paths files < env.yaml < command line;
    # env.yaml under NEMO_GYM_EXTRA_ROOTS first, then the working folder.
    from gym_ray import cli
    from gym_ray.servers import start_in_thread

    rows = _write_rows(tmp_path / "in.jsonl", calc_rows(2))
    base = tmp_path / "base.yaml"
    base.write_text("num_repeats: 5\nlimit: 1\n", encoding="utf-8")
    work, extra = tmp_path / "work", tmp_path / "extra"
    work.mkdir(), extra.mkdir()
    (work / "env.yaml").write_text(f"config_paths: [{base}]\nnum_repeats: 2\n", encoding="utf-8")
    monkeypatch.chdir(work)
    monkeypatch.delenv("NEMO_GYM_EXTRA_ROOTS", raising=False)
    with start_in_thread(calc_config(seed=3, latency_ms=1, latency_jitter_ms=0)) as dep:

        def planned(name: str, *extra_args: str) -> int:
            out = tmp_path / name / "r.jsonl"
            argv = ["run", *_head_args(dep), f"+input_jsonl_fpath={rows}", f"+output_jsonl_fpath={out}"]
            assert cli.main([*argv, *extra_args, "--local", "--progress", "off"]) == 0, (
                capsys.readouterr().err
            )
            return len(_lines(out.parent / "r_materialized_inputs.jsonl"))

        assert planned("a") == 2  # limit 1 from the config_paths file, 2 repeats from env.yaml
        assert planned("b", "+num_repeats=3") == 3  # the command line wins
        (extra / "env.yaml").write_text("num_repeats: 4\n", encoding="utf-8")
        monkeypatch.setenv("NEMO_GYM_EXTRA_ROOTS", str(extra))
        assert planned("c") == 8  # the extra root's env.yaml, found first: no config_paths, no limit


# --- item 7: the metrics file's bytes, one warning line, flags between overrides ------------------------


async def test_the_metrics_file_has_0_7s_bytes(calc: Deployment, tmp_path: Path) -> None:
    # rollout_collection.py, _call_aggregate_metrics: orjson.dumps(entries, option=OPT_INDENT_2), no newline.
    import orjson

    out = tmp_path / "r.jsonl"
    await acollect_local(calc.config, rows=calc_rows(3), output_jsonl_fpath=str(out), num_repeats=2)
    data = (tmp_path / "r_aggregate_metrics.json").read_bytes()
    assert data == orjson.dumps(json.loads(data), option=orjson.OPT_INDENT_2)
    assert data.endswith(b"\n  }\n]")


def test_a_flag_between_overrides_and_one_warning_line(tmp_path: Path) -> None:
    # `gym-ray run` as a process: a flag between the overrides takes none of them away, and the agent_map
    # override warning (0.7's, in our words) is one line, once, without Python's source line.
    import subprocess
    import sys

    from gym_ray.servers import start_in_thread

    cfg = calc_config(seed=3, latency_ms=1, latency_jitter_ms=0)
    other = {
        "host": "127.0.0.1",
        "port": 0,
        "agent_server": {"type": "responses_api_agents", "name": "other"},
    }
    cfg["other"] = {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 0}}}
    cfg["other_env"] = {"environment_servers": {"example_env": other}}
    rows = [{**row, keys.AGENT_REF: {"name": "other"}} for row in calc_rows(3)]
    inputs = _write_rows(tmp_path / "in.jsonl", rows)
    with start_in_thread(cfg) as dep:
        host, port = _head_args(dep)
        argv = [
            host,
            "--no-health-check",
            port,
            "+agent_name=calc_agent",
            "--local",
            f"+input_jsonl_fpath={inputs}",
        ]
        argv += ["--progress", "off", f"+output_jsonl_fpath={tmp_path / 'r.jsonl'}"]
        done = subprocess.run(
            [sys.executable, "-m", "gym_ray.cli", "run", *argv], capture_output=True, text=True, timeout=60
        )
        assert dep.stats("calc_env").requests == 3
    assert done.returncode == 0, done.stderr
    assert done.stderr == (
        "gym-ray run: warning: agent_map overrode agent_ref values already present in the rows: "
        "[('other', 'calc_agent')]\n"
    )


# --- item 6b: resume_from_cache=true on NeMo Gym 0.7's own output ---------------------------------------


async def test_resume_from_cache_on_0_7s_output_is_refused_before_anything_is_written(
    calc: Deployment, tmp_path: Path
) -> None:
    from gym_ray.errors import ResumeError

    # What ng_collect_rollouts leaves: P and its side files, no gym_ray run folder.
    files = {
        "r.jsonl": '{"_ng_task_index": 0, "_ng_rollout_index": 0, "reward": 1.0}\n',
        "r_failures.jsonl": "",
        "r_materialized_inputs.jsonl": '{"_ng_task_index": 0, "_ng_rollout_index": 0}\n',
        "r_aggregate_metrics.json": "[]",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    out = str(tmp_path / "r.jsonl")
    with pytest.raises(ResumeError) as info:
        await acollect_local(calc.config, rows=calc_rows(2), output_jsonl_fpath=out, resume_from_cache=True)
    assert str(info.value) == (
        f"resume_from_cache is true, but {tmp_path} holds output for {out} (r.jsonl, r_failures.jsonl, "
        f"r_materialized_inputs.jsonl) and no gym_ray run folder ({tmp_path / 'r_run' / 'run_manifest.json'} "
        "is missing): gym_ray cannot resume NeMo Gym's own output, and a run would collect every rollout "
        "again and replace those files; resume it with ng_collect_rollouts, or move the files aside (or pass "
        "another output_jsonl_fpath) for a gym_ray run"
    )
    assert calc.stats("calc_env").requests == 0
    assert sorted(await asyncio.to_thread(os.listdir, tmp_path)) == sorted(files)  # no run folder either
    assert {name: (tmp_path / name).read_text(encoding="utf-8") for name in files} == files
