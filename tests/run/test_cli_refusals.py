"""Issue 30, item 7: a refused input is one line naming the file's line, and leaves nothing behind.

The unknown-agent error was three lines numbering rows from 0 ("row 5") while the JSON error numbers lines
from 1 ("line 6"); both refusals left the empty parent folders of ``output_dir`` they had made. Real
``gym-ray run`` processes, with ``--local`` and on Ray (refused before Ray starts).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gym_ray.servers import calc_config, calc_rows, start_in_thread
from gym_ray.servers.launch import ThreadedDeployment
from tests.run._cli import gym_ray, write_yaml

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def servers() -> Iterator[ThreadedDeployment]:
    with start_in_thread(calc_config(seed=3, latency_ms=0, latency_jitter_ms=0)) as deployment:
        yield deployment


def _rows_with(path: Path, line_6: str) -> Path:
    """Rows of the calc config with ``line_6`` as the file's sixth line (of eight)."""
    lines = [json.dumps(row) for row in calc_rows(7)]
    path.write_text("\n".join([*lines[:5], line_6, *lines[5:]]) + "\n")
    return path


UNKNOWN_AGENT = json.dumps(
    {"responses_create_params": {"input": "What is 1 + 1?"}, "agent_ref": {"name": "calc_agnet"}}
)


@pytest.mark.parametrize("where", [pytest.param(["--local"], id="local"), pytest.param([], id="ray")])
@pytest.mark.parametrize(
    ("line_6", "expected"),
    [
        pytest.param(
            UNKNOWN_AGENT,
            "line 6: unknown agent: 'calc_agnet' is not in the running config (did you mean 'calc_agent'?); "
            "the config's agents: calc_agent; include the agent's config in the run or re-route the rows "
            "with agent_map",
            id="unknown-agent",
        ),
        pytest.param(
            '{"responses_create_params": ',
            "line 6: malformed JSON (Expecting value at column 29): '{\"responses_create_params\":'",
            id="bad-json",
        ),
    ],
)
def test_a_bad_line_is_one_line_numbered_as_the_file_and_leaves_no_folder(
    tmp_path: Path, servers: ThreadedDeployment, where: list[str], line_6: str, expected: str
) -> None:
    config = write_yaml(tmp_path / "run.yaml", servers.config)
    rows = _rows_with(tmp_path / "rows.jsonl", line_6)
    out = tmp_path / "runs" / "sweep" / "r1"
    done = gym_ray(
        ["run", str(config), f"+input_jsonl_fpath={rows}", f"+output_dir={out}", "--progress", "off", *where],
        cwd=tmp_path,
        timeout_s=90,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"gym-ray run: error: {rows}, {expected}\n"
    assert not (tmp_path / "runs").exists()  # neither the folder nor the parents the run had made
    assert servers.stats("calc_env").requests == 0


@pytest.mark.parametrize(
    ("key", "url", "give"),
    [
        pytest.param(
            "output_dir",
            "gs://bucket/prefix/r1",
            "give a local path or s3://BUCKET/PREFIX (any S3-compatible store through AWS_ENDPOINT_URL)",
            id="gs-output",
        ),
        pytest.param(
            "input_jsonl_fpath",
            "s3://bucket/rows.jsonl",
            "give a path on a file system (on a cluster, one every node mounts: cluster/README.md)",
            id="s3-input",
        ),
        pytest.param(
            "output_jsonl_fpath",
            "file:///tmp/out.jsonl",
            "give a path on a file system (on a cluster, one every node mounts: cluster/README.md)",
            id="file-url-output",
        ),
    ],
)
def test_a_url_in_a_path_setting_is_refused_before_anything_and_no_local_folder_is_made(
    tmp_path: Path, servers: ThreadedDeployment, key: str, url: str, give: str
) -> None:
    # Issue 34: `+output_dir=s3://runs/r1` ran to exit 0 writing a local folder named "s3:". s3:// run
    # folders are supported now (tests/store); any other URL is refused with what to give instead.
    config = write_yaml(tmp_path / "run.yaml", servers.config)
    settings = {"input_jsonl_fpath": str(_rows_with(tmp_path / "rows.jsonl", json.dumps(calc_rows(8)[7])))}
    settings["output_dir"] = str(tmp_path / "out")
    settings[key] = url
    done = gym_ray(
        ["run", str(config), *(f"+{k}={v}" for k, v in settings.items()), "--progress", "off"],
        cwd=tmp_path,
        timeout_s=90,
    )
    scheme = url.split("://")[0]
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"gym-ray run: error: config key '{key}' is {url!r}: a {scheme}:// URL is not supported here: "
        f"{give}\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl", "run.yaml"]
    assert servers.stats("calc_env").requests == 0
