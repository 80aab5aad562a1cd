"""gym_ray as a drop-in for NeMo Gym 0.7's ``ng_collect_rollouts``: the same command line, options honoured
or refused, NeMo Gym's output layout, the head overlay, head_server_config forms, host-less configs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray import cli, keys
from gym_ray.config.run_config import resolve_run_config
from gym_ray.config.settings import load_config
from gym_ray.config.strict import REFUSED_OPTIONS
from gym_ray.config.topology import Topology
from gym_ray.dispatch.helper import RolloutCollectionHelper
from gym_ray.distributed.api import worker_shares
from gym_ray.errors import ConfigError, IncompleteRunError, ResumeError
from gym_ray.finalize.nemo_layout import nemo_gym_paths
from gym_ray.plan.preprocess import preprocess_examples, validate_rows
from gym_ray.run.collect import acollect_local
from gym_ray.servers import (
    Deployment,
    ThreadedDeployment,
    bundled_dataset_path,
    calc_config,
    calc_rows,
    load_bundled_config,
    serve_config,
    start_in_thread,
)

pytestmark = pytest.mark.timeout(180)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _agentless_input(path: Path, count: int) -> Path:
    """The bundled dataset's first ``count`` rows without agent_ref (so +agent_name decides the agent)."""
    lines = bundled_dataset_path().read_text(encoding="utf-8").splitlines()[:count]
    with open(path, "w", encoding="utf-8") as out:
        for line in lines:
            row = json.loads(line)
            row.pop(keys.AGENT_REF, None)
            out.write(json.dumps(row) + "\n")
    return path


# --- the NeMo Gym command line, end to end on Ray ----------------------------------------------------


@pytest.fixture(scope="module")
def slow_servers() -> Iterator[ThreadedDeployment]:
    cfg = load_bundled_config()
    for env in ("arith_env", "arith_env_hard"):
        block = cfg[env]["environment_servers"]["example_env"]
        block["latency_ms"], block["latency_jitter_ms"] = 150, 0
    with start_in_thread(cfg) as deployment:
        yield deployment


@pytest.mark.ray
def test_a_nemo_gym_command_line_runs_unchanged(
    ray_session: Any, slow_servers: ThreadedDeployment, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = _agentless_input(tmp_path / "input.jsonl", 40)
    host, port = slow_servers.head_url.removeprefix("http://").rsplit(":", 1)
    out = tmp_path / "results" / "rollouts.jsonl"
    argv = [
        "run",
        f"+head_server.host={host}",
        f"+head_server.port={port}",
        "+agent_name=arith_agent",
        f"+input_jsonl_fpath={rows}",
        f"+output_jsonl_fpath={out}",
        "+num_samples_in_parallel=6",
        "+num_repeats=2",
        "+limit=25",
        "+shard_size=6",  # gym_ray's own knob: several shards, so both workers run at once
        "--workers",
        "2",
    ]
    assert cli.main(argv) == 0, capsys.readouterr().err
    # 25 of the 40 input lines, 2 repeats each, all on arith_agent's front (agent_name re-routes every row).
    assert slow_servers.stats("arith_env").requests == 50
    assert slow_servers.stats("arith_env_hard").requests == 0
    # The cap is for the whole run: 2 workers x 3 each, and the server saw exactly 6 at once.
    assert slow_servers.stats("arith_env").max_in_flight == 6
    results = _lines(out)
    assert sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in results) == [
        (t, k) for t in range(25) for k in range(2)
    ]
    assert {r[keys.AGENT_REF]["name"] for r in results} == {"arith_agent"}
    materialized = _lines(tmp_path / "results" / "rollouts_materialized_inputs.jsonl")
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in materialized] == [
        (t, k) for t in range(25) for k in range(2)
    ]
    assert (tmp_path / "results" / "rollouts_failures.jsonl").read_text(encoding="utf-8") == ""
    metrics = json.loads(
        (tmp_path / "results" / "rollouts_aggregate_metrics.json").read_text(encoding="utf-8")
    )
    assert [entry["_ng_environment_server"] for entry in metrics] == ["arith_env"]
    assert metrics[0]["agent_metrics"]["num_repeats"] == 2
    # The shard files and manifests stay in the run folder beside P.
    run_dir = tmp_path / "results" / "rollouts_run"
    assert (run_dir / "run_manifest.json").is_file()
    assert sorted(p.name for p in run_dir.glob("rollouts-*.manifest.json")) == [
        f"rollouts-{i:05d}.manifest.json" for i in range(9)
    ]
    assert f"rollouts:  {out}" in capsys.readouterr().out


def test_a_misspelt_override_is_refused_with_the_closest_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "+num_repeat=3", f"+input_jsonl_fpath={tmp_path / 'in.jsonl'}", f"+output_dir={tmp_path}"]
    assert cli.main(["run", *argv[1:], "--local"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "gym-ray run: error: config key 'num_repeat' is not a setting, a server instance or a key an "
        "interpolation refers to (did you mean 'num_repeats'?). Settings are documented in docs/nemo-gym.md "
        "(NeMo Gym options) and gym_ray.config.settings.RunSettings (every setting)"
    )
    assert not list(tmp_path.iterdir())  # refused before anything was written


#: A config that addresses its own server (so no head server is asked).
_STANDALONE = "a: {responses_api_agents: {example_env: {host: 127.0.0.1, port: 9}}}\n"


async def test_a_key_an_interpolation_refers_to_is_allowed(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(_STANDALONE + "judge_model: m1\nresponses_create_params: {model: '${judge_model}'}\n")
    run = await resolve_run_config(str(path))
    assert run.settings.responses_create_params == {"model": "m1"}
    path.write_text(_STANDALONE + "judge_model: m1\n")
    with pytest.raises(ConfigError, match="config key 'judge_model' is not a setting"):
        await resolve_run_config(str(path))


@pytest.mark.parametrize(
    ("option", "value", "instead"),
    [
        pytest.param("prompt_config", "p.yaml", "render the prompt template", id="prompt_config"),
        pytest.param("skills", {"path": "s"}, "stamp skills_ref", id="skills"),
        pytest.param("count_failure_classes_as_zero", ["agent_run_error"], "does not impute", id="fail0"),
        pytest.param("count_missing_rollouts_as_zero", True, "does not impute", id="missing0"),
        pytest.param("rollout_collection_driver", "m:f", "no pluggable driver", id="driver"),
        pytest.param("dispatch_longest_first", True, "planned order", id="longest_first"),
        pytest.param("retry_terminal_timeouts", True, "never retries a terminal failure", id="retry_term"),
        pytest.param("retry_invalid_judge_responses", True, "does not migrate", id="judge"),
        pytest.param("upload_rollouts_to_wandb", True, "no exporters", id="wandb"),
    ],
)
async def test_a_nemo_gym_option_gym_ray_does_not_honour_is_refused(
    option: str, value: Any, instead: str
) -> None:
    with pytest.raises(ConfigError) as info:
        await resolve_run_config({option: value})
    assert str(info.value).startswith(f"config key '{option}' ({value!r}) is not supported: ")
    assert instead in str(info.value)
    assert info.value.key == option
    # Their NeMo Gym defaults (nothing asked of gym_ray) pass.
    standalone = load_bundled_config()  # addresses its servers: no head server is asked
    await resolve_run_config({**standalone, option: None if value not in (True, False) else False})
    assert set(REFUSED_OPTIONS) >= {option}


async def test_options_that_mean_nothing_in_their_mode_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"'environment_server_name' is used only with .*=legacy"):
        await resolve_run_config({**load_bundled_config(), "environment_server_name": "arith_env"})
    legacy = {"environment_routing_mode": "legacy", "environment_server_name": "arith_env"}
    with pytest.raises(ConfigError, match="'agent_name' has no effect with environment_routing_mode=legacy"):
        await resolve_run_config({**load_bundled_config(), **legacy, "agent_name": "arith_agent"})
    with pytest.raises(ConfigError, match=r"agent_name='a' conflicts with agent_map\._default='b'"):
        await resolve_run_config({"agent_name": "a", "agent_map": {"_default": "b"}})
    with pytest.raises(ConfigError, match="config key 'limit' is -1"):
        await resolve_run_config({"limit": -1})


def test_hydra_spellings_from_nemo_gym_docs(tmp_path: Path) -> None:
    extra = tmp_path / "extra.yaml"
    extra.write_text("num_repeats: 4\nlimit: 9\n")
    cfg = load_config(
        [],
        [
            "+agent_map={_default:simple_agent,math:math_agent}",
            "+num_repeats={math:3,_default:1}",
            "+health_check_ignored_checks=[a,b]",
            "+environment_server_routes={sim:val:env}",
            "+prompt_config='a,b'",
            "++limit=5",
            f"config_paths=[{extra}]",
        ],
    )
    assert cfg == {
        "agent_map": {"_default": "simple_agent", "math": "math_agent"},
        "num_repeats": {"math": 3, "_default": 1},  # the CLI wins over config_paths files
        "health_check_ignored_checks": ["a", "b"],
        "environment_server_routes": {"sim": "val:env"},
        "prompt_config": "a,b",
        "limit": 5,
        "config_paths": [str(extra)],
    }


@pytest.mark.parametrize(
    ("output", "failures", "materialized", "metrics"),
    [
        ("results/rollouts.jsonl", "rollouts_failures.jsonl", "rollouts_materialized_inputs.jsonl",
         "rollouts_aggregate_metrics.json"),
        ("rollouts", "rollouts_failures.jsonl", "rollouts_materialized_inputs.jsonl",
         "rollouts_aggregate_metrics.json"),
        ("out/a.b.jsonl", "a.b_failures.jsonl", "a.b_materialized_inputs.jsonl",
         "a.b_aggregate_metrics.json"),
        ("out/v1.5", "v1_failures.jsonl", "v1_materialized_inputs.jsonl", "v1_aggregate_metrics.json"),
    ],
)  # fmt: skip
def test_side_files_are_named_as_nemo_gym_names_them(
    output: str, failures: str, materialized: str, metrics: str
) -> None:
    paths = nemo_gym_paths(output)
    parent = Path(output).parent
    assert (paths.rollouts, paths.failures) == (Path(output), parent / failures)
    assert (paths.materialized_inputs, paths.aggregate_metrics) == (parent / materialized, parent / metrics)


def test_the_cap_is_split_so_the_shares_sum_to_it() -> None:
    assert worker_shares(6, 2) == [3, 3]
    assert worker_shares(7, 3) == [3, 2, 2]
    assert worker_shares(None, 2) == [None, None]


# --- honoured options, in one process ------------------------------------------------------------------


def _calc_config(*, faults: dict[str, Any] | None = None) -> dict[str, Any]:
    return calc_config(seed=3, latency_ms=1, latency_jitter_ms=0, **({"faults": faults} if faults else {}))


_rows = calc_rows


@pytest.fixture
async def calc() -> AsyncIterator[Deployment]:
    async with serve_config(_calc_config()) as dep:
        yield dep


async def test_disable_aggregation_writes_no_metrics_and_calls_no_server(
    calc: Deployment, tmp_path: Path
) -> None:
    out = tmp_path / "r.jsonl"
    result = await acollect_local(
        calc.config, rows=_rows(3), output_jsonl_fpath=str(out), disable_aggregation=True
    )
    assert result.metrics_path is None
    assert calc.stats("calc_env").aggregate_calls == 0
    assert not (tmp_path / "r_aggregate_metrics.json").exists()
    assert len(_lines(out)) == 3


async def test_limit_zero_means_every_row_and_limit_cuts_the_head(calc: Deployment, tmp_path: Path) -> None:
    every = await acollect_local(calc.config, rows=_rows(5), output_dir=str(tmp_path / "a"), limit=0)
    assert every.planned == 5
    head = await acollect_local(
        calc.config, rows=_rows(5), output_dir=str(tmp_path / "b"), limit=2, num_repeats=3
    )
    assert head.planned == 6
    contents = {r["expected_answer"] for r in _lines(Path(head.rollouts_path))}
    assert contents == {"1", "2"}


async def test_require_complete_fails_the_run_after_writing_its_files(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    async with serve_config(_calc_config(faults={"error_rate": 1.0})) as dep:
        with pytest.raises(IncompleteRunError) as info:
            await acollect_local(
                dep.config, rows=_rows(4), output_jsonl_fpath=str(out), require_complete=True
            )
    assert str(info.value) == (
        f"run folder {tmp_path / 'r_run'} is incomplete: 4 failed and 0 pending of 4 planned rollouts "
        "(0 succeeded, 4 failed attempts); 4 would run again: run again on the same output_dir to resume"
    )
    assert len(_lines(tmp_path / "r_failures.jsonl")) == 4
    assert out.read_text(encoding="utf-8") == ""


async def test_resume_from_cache(calc: Deployment, tmp_path: Path) -> None:
    out = str(tmp_path / "r.jsonl")
    first = await acollect_local(calc.config, rows=_rows(3), output_jsonl_fpath=out)
    assert first.dispatched == 3
    again = await acollect_local(calc.config, rows=_rows(3), output_jsonl_fpath=out, resume_from_cache=True)
    assert (again.dispatched, again.succeeded) == (0, 3)
    with pytest.raises(ResumeError, match="already holds a run and resume_from_cache is false"):
        await acollect_local(calc.config, rows=_rows(3), output_jsonl_fpath=out, resume_from_cache=False)


async def test_num_repeats_add_seed_stamps_the_rollout_index(calc: Deployment, tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    await acollect_local(calc.config, rows=_rows(1), output_jsonl_fpath=str(out), num_repeats=3,
                         num_repeats_add_seed=True)  # fmt: skip
    seeds = [
        json.loads(r["responses_create_params"]["metadata"]["extra_body"])["seed"]
        for r in _lines(tmp_path / "r_materialized_inputs.jsonl")
    ]
    assert seeds == [0, 1, 2]


async def test_legacy_mode_sends_every_row_to_the_named_server(tmp_path: Path) -> None:
    cfg = _calc_config()
    cfg["other_env"] = json.loads(json.dumps(cfg["calc_env"]))
    async with serve_config(cfg) as dep:
        await acollect_local(
            dep.config,
            rows=_rows(3),
            output_dir=str(tmp_path / "run"),
            environment_routing_mode="legacy",
            environment_server_name="other_env",
        )
        assert (dep.stats("other_env").requests, dep.stats("calc_env").requests) == (3, 0)


# --- the head overlay, head_server_config forms, host-less configs -------------------------------------


def _local_overlay(dep: Deployment) -> dict[str, Any]:
    """NeMo Gym's overlay: the head address plus the agent's server YAML block, without addresses."""
    agent = {"responses_api_agents": {"example_env": {}}}
    return {"head_server": dep.config["head_server"], "calc_agent": agent}


async def test_an_overlay_config_reaches_the_environment_server_the_head_declares(
    calc: Deployment, tmp_path: Path
) -> None:
    result = await acollect_local(_local_overlay(calc), rows=_rows(4), output_dir=str(tmp_path / "run"))
    assert result.succeeded == 4
    assert calc.stats("calc_env").requests == 4
    assert {r[keys.ENVIRONMENT_SERVER] for r in _lines(Path(result.rollouts_path))} == {"calc_env"}


async def test_an_overlay_block_that_disagrees_with_the_head_is_an_error(calc: Deployment) -> None:
    local = _local_overlay(calc)
    local["calc_env"] = {"environment_servers": {"example_env": {"seed": 99}}}
    with pytest.raises(ConfigError) as info:
        await resolve_run_config(local)
    assert str(info.value) == (
        "config key 'calc_env.environment_servers.example_env.seed' is 99 in the run's config but 3 on the "
        "head server; the running deployment is the truth: drop the local value or make it agree"
    )
    local["calc_env"] = {"resources_servers": {"example_resources": {}}}
    with pytest.raises(ConfigError, match=r"is resources_servers\.example_resources in the run's config"):
        await resolve_run_config(local)


class _BaseServerConfig:
    """NeMo Gym's BaseServerConfig shape: an object with host and port attributes."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port


@pytest.mark.parametrize("form", ["mapping", "object"])
async def test_head_server_config_as_nemo_gym_callers_pass_it(calc: Deployment, form: str) -> None:
    head = calc.config["head_server"]
    config = dict(head) if form == "mapping" else _BaseServerConfig(head["host"], head["port"])
    helper = RolloutCollectionHelper(config)
    try:
        await helper.setup_server_client()
        assert helper.topology is not None
        assert helper.topology.environment_servers() == ("calc_env",)
        completions = helper.run_examples(helper.preprocess_examples(_rows(2)))
        try:
            outcomes = [await future for future in completions]
        finally:
            await completions.aclose()
        assert len(outcomes) == 2
        assert calc.stats("calc_env").requests == 2
    finally:
        await helper.aclose()


def test_preprocessing_and_validation_need_no_addresses() -> None:
    hostless = {
        "calc_resources": {"resources_servers": {"example_resources": {}}},
        "calc_agent": {
            "responses_api_agents": {
                "example_env": {"resources_server": {"type": "resources_servers", "name": "calc_resources"}}
            }
        },
        "calc_env": {
            "environment_servers": {
                "example_env": {"agent_server": {"type": "responses_api_agents", "name": "calc_agent"}}
            }
        },
    }
    rows = [{"responses_create_params": {"input": "1+1?"}, "task_source": "calc_resources"}]
    out = preprocess_examples(rows, num_repeats=2, global_config_dict=hostless)
    assert [r[keys.AGENT_REF] for r in out] == [{"name": "calc_agent"}] * 2
    topology = Topology.from_config(hostless)
    validate_rows(out, topology)
    assert topology.environment_server_for_row(out[0]) == "calc_env"
    with pytest.raises(ConfigError) as info:
        topology.url_of("calc_env")
    assert str(info.value).startswith(
        "server instance 'calc_env' has no address (config keys "
        "'calc_env.environment_servers.example_env.host'"
    )


async def test_dispatch_with_a_host_less_config_names_the_instance(calc: Deployment, tmp_path: Path) -> None:
    # Blocks the head does not define, without addresses (with no head named, NeMo Gym's default head
    # address is asked instead: tests/config/test_nemo_gym_head.py).
    hostless = {
        "head_server": calc.config["head_server"],
        "far_agent": {"responses_api_agents": {"example_env": {}}},
        "far_env": {
            "environment_servers": {
                "example_env": {"agent_server": {"type": "responses_api_agents", "name": "far_agent"}}
            }
        },
    }
    rows = [{**row, keys.AGENT_REF: {"name": "far_agent"}} for row in _rows(1)]
    with pytest.raises(ConfigError, match=r"^server instance 'far_env' has no address") as info:
        await acollect_local(hostless, rows=rows, output_dir=str(tmp_path / "run"))
    assert info.value.key == "far_env.environment_servers.example_env"
