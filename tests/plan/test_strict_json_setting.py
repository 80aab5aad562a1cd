"""``strict_json``, the run setting: on by default, it refuses duplicate keys in the input with the file and
line before anything is sent; ``false`` accepts them. Non-finite numbers (rows passed with ``nan`` / ``inf``)
are refused either way with the row: JSON cannot carry them, so nothing may send them on. It reaches the
single-process run and the Ray driver (both plan through ``input_rows``); a misspelt key is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gym_ray.distributed.api import acollect
from gym_ray.errors import ConfigError, InputError
from gym_ray.run.collect import acollect_local
from gym_ray.servers import calc_config, serve_config, start_in_thread
from gym_ray.streaming.api import stream

pytestmark = pytest.mark.timeout(120)

HINT = "or set strict_json: false (+strict_json=false) to accept it as Python's json does"
NON_FINITE = (
    "(not JSON); JSON cannot carry it, so no request body may hold it; write None, a finite number, or a "
    'string such as "nan" if the server expects one'
)
DUPLICATE = (
    "duplicate key 'expected_answer' in one JSON object (a JSON reader keeps only one of the values); "
    f"remove or rename one of them, {HINT}"
)


def _row(i: int) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 1?"}]},
        "expected_answer": str(i + 1),
        "agent_ref": {"name": "calc_agent"},
    }


def _yaml(tmp_path: Path, config: dict[str, Any]) -> str:
    """The served config as a YAML file (JSON is YAML): overrides apply to config files, as on the CLI."""
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config))
    return str(path)


def _input_file(tmp_path: Path) -> Path:
    """Three rows; line 2 names ``expected_answer`` twice (JSON keeps one of them, Python the last)."""
    second = json.dumps(_row(1))[:-1] + ', "expected_answer": "2"}'
    path = tmp_path / "in.jsonl"
    path.write_text(f"{json.dumps(_row(0))}\n{second}\n{json.dumps(_row(2))}\n")
    return path


async def test_local_run_refuses_a_duplicate_key_with_file_and_line_unless_strict_json_is_off(
    tmp_path: Path,
) -> None:
    path = _input_file(tmp_path)
    async with serve_config(calc_config(seed=3)) as dep:
        with pytest.raises(InputError) as caught:
            await acollect_local(
                _yaml(tmp_path, dep.config),
                overrides=[f"+input_jsonl_fpath={path}", f"+output_dir={tmp_path / 'a'}"],
            )
        assert str(caught.value) == f"{path}, line 2: {DUPLICATE}"
        assert (caught.value.path, caught.value.line) == (str(path), 2)
        assert dep.stats("calc_env").requests == 0  # refused before anything was sent
        assert not list((tmp_path / "a").glob("rollouts-*.jsonl"))

        result = await acollect_local(
            _yaml(tmp_path, dep.config),
            overrides=[f"+input_jsonl_fpath={path}", f"+output_dir={tmp_path / 'b'}", "+strict_json=false"],
        )
        assert (result.planned, result.succeeded, result.failed) == (3, 3, 0)
        assert dep.stats("calc_env").requests == 3


@pytest.mark.parametrize("strict_json", [True, False])
async def test_rows_passed_with_nan_are_refused_by_row_whatever_strict_json_says(
    tmp_path: Path, strict_json: bool
) -> None:
    rows = [_row(0), {**_row(1), "extra": {"w": [1.0, float("nan")]}}]
    async with serve_config(calc_config(seed=3)) as dep:
        with pytest.raises(InputError) as caught:
            await acollect_local(
                dep.config, rows=rows, output_dir=str(tmp_path / "a"), strict_json=strict_json
            )
        assert str(caught.value) == f"input row 1: non-finite number nan at extra.w[1] {NON_FINITE}"
        assert caught.value.row == 1
        assert dep.stats("calc_env").requests == 0


async def test_a_misspelt_strict_json_key_is_refused_not_ignored(tmp_path: Path) -> None:
    async with serve_config(calc_config(seed=3)) as dep:
        with pytest.raises(
            ConfigError, match=r"config key 'strict_jsn' is not a setting.*did you mean 'strict_json'"
        ):
            await acollect_local(
                _yaml(tmp_path, dep.config),
                rows=[_row(0)],
                output_dir=str(tmp_path),
                overrides=["+strict_jsn=false"],
            )
        with pytest.raises(ConfigError, match=r"config key 'strict_json' is 'maybe'.*allowed: bool"):
            await acollect_local(
                _yaml(tmp_path, dep.config),
                rows=[_row(0)],
                output_dir=str(tmp_path),
                overrides=["+strict_json=maybe"],
            )
        assert dep.stats("calc_env").requests == 0


@pytest.mark.ray
async def test_the_ray_driver_honours_strict_json_both_ways(ray_session: Any, tmp_path: Path) -> None:
    path = _input_file(tmp_path)
    with start_in_thread(calc_config(seed=3)) as servers:
        common = [f"+input_jsonl_fpath={path}"]
        with pytest.raises(InputError) as caught:
            await acollect(
                _yaml(tmp_path, servers.config),
                overrides=[*common, f"+output_dir={tmp_path / 'a'}"],
                num_workers=1,
            )
        assert str(caught.value) == f"{path}, line 2: {DUPLICATE}"
        assert servers.stats("calc_env").requests == 0
        result = await acollect(
            _yaml(tmp_path, servers.config),
            overrides=[*common, f"+output_dir={tmp_path / 'b'}", "+strict_json=false"],
            num_workers=1,
        )
        assert (result.planned, result.succeeded, result.failed) == (3, 3, 0)
        assert servers.stats("calc_env").requests == 3


@pytest.mark.ray
async def test_the_stream_refuses_a_nan_row_whatever_its_config_says(ray_session: Any) -> None:
    rows = [_row(0), {**_row(1), "extra": {"w": float("inf")}}, _row(2)]
    async with serve_config(calc_config(seed=3)) as dep:

        async def consume(config: dict[str, Any]) -> None:
            async with stream(rows, config=config, num_workers=1, max_in_flight=2) as rollouts:
                async for _ in rollouts:
                    pass

        for config in (dep.config, {**dep.config, "strict_json": False}):
            with pytest.raises(InputError) as caught:
                await consume(config)
            assert str(caught.value) == f"stream input row 1: non-finite number inf at extra.w {NON_FINITE}"
            assert caught.value.row == 1
