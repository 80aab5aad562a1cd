"""`gym-ray run` refuses what it can know before dispatch, before Ray starts, with one true line.

Each test runs the CLI as a subprocess with its own ``RAY_TMPDIR`` and asserts the exit status, the exact
first line of stderr, that no Ray session folder appeared under that ``RAY_TMPDIR`` (Ray was not started,
robust to other Ray instances on the machine) and that the run folder was not created.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gym_ray.servers import load_bundled_config
from tests.run._cli import (
    REPO,
    dead_config,
    first_line,
    gym_ray,
    ray_sessions,
    short_tmp,
    write_rows,
    write_yaml,
)

DEMO = str(REPO / "gym_ray" / "configs" / "demo.yaml")


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    path = short_tmp()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_mount(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (skips where mounting is not allowed), unmounted afterwards."""
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def _refused(result: subprocess.CompletedProcess[str], status: int, line: str, ray_tmp: Path) -> None:
    assert (result.returncode, first_line(result.stderr)) == (status, line), result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert ray_sessions(ray_tmp) == []


def test_port_0_is_refused_naming_the_instance_and_url(tmp_path: Path, ray_tmp: Path) -> None:
    rows = write_rows(tmp_path / "rows.jsonl", 3)
    out = tmp_path / "out"
    result = gym_ray(
        ["run", DEMO, f"+input_jsonl_fpath={rows}", f"+output_dir={out}"], cwd=tmp_path, ray_tmp=ray_tmp
    )
    _refused(
        result,
        2,
        "gym-ray run: error: environment server 'arith_env' has port 0 (http://127.0.0.1:0): 0 means 'any "
        "free port' to a server being started, not an address to send rollouts to; point the run at the "
        "running servers (the run config `gym-ray serve` writes, or their real host:port)",
        ray_tmp,
    )
    assert not out.exists()


def test_port_0_is_refused_even_without_the_health_check(tmp_path: Path, ray_tmp: Path) -> None:
    rows = write_rows(tmp_path / "rows.jsonl", 3)
    args = ["run", DEMO, f"+input_jsonl_fpath={rows}", f"+output_dir={tmp_path / 'out'}", "--no-health-check"]
    result = gym_ray(args, cwd=tmp_path, ray_tmp=ray_tmp)
    assert result.returncode == 2
    assert first_line(result.stderr).startswith(
        "gym-ray run: error: environment server 'arith_env' has port 0"
    )
    assert ray_sessions(ray_tmp) == []


def test_a_dead_server_is_refused_by_the_health_check(tmp_path: Path, ray_tmp: Path) -> None:
    config = dead_config(tmp_path / "dead.yaml")
    port = load_port(config)
    rows = write_rows(tmp_path / "rows.jsonl", 3)
    out = tmp_path / "out"
    started = time.monotonic()
    result = gym_ray(
        ["run", str(config), f"+input_jsonl_fpath={rows}", f"+output_dir={out}"],
        cwd=tmp_path,
        ray_tmp=ray_tmp,
    )
    _refused(
        result,
        1,
        f"gym-ray run: ServerConnectionError: environment server 'arith_env' at http://127.0.0.1:{port} is "
        "not reachable (Connection refused); start it (gym-ray serve CONFIG) or fix its host/port in the "
        "config (or skip this check: --no-health-check / health_check=false)",
        ray_tmp,
    )
    assert not out.exists()
    print(f"dead server refused in {time.monotonic() - started:.1f} s (process start and imports included)")


def load_port(config: Path) -> int:
    import yaml

    return int(yaml.safe_load(config.read_text())["arith_env"]["environment_servers"]["example_env"]["port"])


@pytest.mark.parametrize("mode", [pytest.param([], id="ray"), pytest.param(["--local"], id="local")])
def test_an_empty_input_file_is_refused(tmp_path: Path, ray_tmp: Path, mode: list[str]) -> None:
    config = _live_free_config(tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    out = tmp_path / "out"
    result = gym_ray(
        ["run", str(config), f"+input_jsonl_fpath={empty}", f"+output_dir={out}", *mode],
        cwd=tmp_path,
        ray_tmp=ray_tmp,
    )
    _refused(
        result,
        2,
        f"gym-ray run: error: input file '{empty}' (input_jsonl_fpath) is empty: it holds no rows; pass a "
        "JSONL file with one task per line",
        ray_tmp,
    )
    assert not out.exists()


def test_a_missing_input_file_is_refused(tmp_path: Path, ray_tmp: Path) -> None:
    config = _live_free_config(tmp_path)
    missing = tmp_path / "nope.jsonl"
    result = gym_ray(
        ["run", str(config), f"+input_jsonl_fpath={missing}", f"+output_dir={tmp_path / 'out'}"],
        cwd=tmp_path,
        ray_tmp=ray_tmp,
    )
    _refused(
        result,
        2,
        f"gym-ray run: error: input file '{missing}' (input_jsonl_fpath) does not exist; check the path",
        ray_tmp,
    )


def test_an_output_dir_that_is_a_file_is_refused(tmp_path: Path, ray_tmp: Path) -> None:
    config = _live_free_config(tmp_path)
    rows = write_rows(tmp_path / "rows.jsonl", 3)
    a_file = tmp_path / "results.txt"
    a_file.write_text("keep me\n")
    result = gym_ray(
        ["run", str(config), f"+input_jsonl_fpath={rows}", f"+output_dir={a_file}"],
        cwd=tmp_path,
        ray_tmp=ray_tmp,
    )
    _refused(
        result,
        2,
        f"gym-ray run: error: output_dir '{a_file}' is a file; pass a folder path (a new one, or a run "
        "folder to resume)",
        ray_tmp,
    )
    assert a_file.read_text() == "keep me\n"


def test_workers_0_is_refused_not_taken_as_the_default(tmp_path: Path, ray_tmp: Path) -> None:
    config = _live_free_config(tmp_path)
    rows = write_rows(tmp_path / "rows.jsonl", 3)
    result = gym_ray(
        [
            "run",
            str(config),
            f"+input_jsonl_fpath={rows}",
            f"+output_dir={tmp_path / 'out'}",
            "--workers",
            "0",
        ],
        cwd=tmp_path,
        ray_tmp=ray_tmp,
    )
    _refused(
        result,
        2,
        "gym-ray run: error: --workers is 0: a run needs at least 1 worker; pass --workers >= 1, or leave it "
        "out to use one worker per CPU (at most 16)",
        ray_tmp,
    )


@pytest.mark.parametrize(
    ("flag", "value"),
    [pytest.param("--workers", "3", id="workers"), pytest.param("--address", "h:6379", id="address")],
)
def test_a_ray_option_with_local_is_refused_not_ignored(
    tmp_path: Path, ray_tmp: Path, flag: str, value: str
) -> None:
    config = _live_free_config(tmp_path)
    rows = write_rows(tmp_path / "rows.jsonl", 3)
    args = ["run", str(config), f"+input_jsonl_fpath={rows}", f"+output_dir={tmp_path / 'out'}"]
    result = gym_ray([*args, "--local", flag, value], cwd=tmp_path, ray_tmp=ray_tmp)
    _refused(
        result,
        2,
        f"gym-ray run: error: {flag} has no effect with --local (one process, no Ray); drop one of them",
        ray_tmp,
    )
    assert not (tmp_path / "out").exists()


def test_no_space_for_the_materialized_inputs_is_refused(
    tmp_path: Path, ray_tmp: Path, small_mount: Path
) -> None:
    """ENOSPC on a 1 MiB tmpfs: 2,000 rows (~230 KiB) x 8 repeats cannot fit; refused before planning."""
    mount = small_mount
    config = _live_free_config(tmp_path)
    rows = write_rows(tmp_path / "rows.jsonl", 2000)
    size = rows.stat().st_size
    free = shutil.disk_usage(mount).free
    assert (free, 2**20 <= 8 * size < 2**30, size < 2**20) == (2**20, True, True)  # the units below
    out = mount / "run"
    result = gym_ray(
        ["run", str(config), f"+input_jsonl_fpath={rows}", f"+output_dir={out}", "+num_repeats=8"],
        cwd=tmp_path,
        ray_tmp=ray_tmp,
    )
    _refused(
        result,
        2,
        f"gym-ray run: error: output_dir '{out}' has {free / 2**20:.1f} MiB free on its file system; the "
        f"run's materialized inputs need at least {8 * size / 2**20:.1f} MiB ({size / 1024:.1f} KiB of "
        "input x 8 rollouts per row); free some space or pass an output_dir on a larger disk",
        ray_tmp,
    )
    assert os.listdir(mount) == []


def test_a_disk_that_fills_while_planning_is_named_in_one_line(
    tmp_path: Path, ray_tmp: Path, small_mount: Path
) -> None:
    """Past the estimate (input x repeats fits, the stamped rows do not): one line naming the path."""
    mount = small_mount
    config = _live_free_config(tmp_path)
    rows = write_rows(tmp_path / "rows.jsonl", 850)
    assert 8 * rows.stat().st_size < shutil.disk_usage(mount).free  # the preflight estimate passes
    out = mount / "run"
    args = ["run", str(config), f"+input_jsonl_fpath={rows}", f"+output_dir={out}", "+num_repeats=8"]
    result = gym_ray([*args, "--local"], cwd=tmp_path, ray_tmp=ray_tmp)
    assert result.returncode == 1, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    pattern = (
        rf"gym-ray run: RecordError: planning the run folder {re.escape(str(out))} failed writing "
        rf"{re.escape(str(out))}/\.staging-[0-9a-f]{{8}}: No space left on device; free space on that disk "
        r"\(or pass an output_dir on a larger one\), then rerun the same command"
    )
    assert re.fullmatch(pattern, first_line(result.stderr)), result.stderr


def _live_free_config(tmp_path: Path) -> Path:
    """A config whose servers need no health check to fail the test: the check is off, ports are real."""
    cfg = load_bundled_config("demo")
    cfg.pop("head_server")
    for block in cfg.values():
        for impls in block.values():
            for fields in impls.values():
                fields["port"] = 9  # discard: never reached, the check is off and preflight refuses first
    cfg["health_check"] = False
    return write_yaml(tmp_path / "config.yaml", cfg)
