"""Every notebook in notebooks/ runs top to bottom (nbclient), writes its plot files, and says nothing on
stderr: no Ray start-up lines, no "Missing packages: ['ipywidgets']", no stack dump when the kernel is
stopped (SIGTERM) at the end (issue 30)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")
pytest.importorskip("pandas")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


#: libzmq's assertion when the kernel's zmq context ends as a socket hangs up (zeromq/libzmq#1307): seen once
#: in about ten runs of one notebook, after every cell ran; it is the kernel's own shutdown, not gym_ray's or
#: Ray's output, which this test keeps at nothing.
_ZMQ_SHUTDOWN_ASSERT = re.compile(r"^Assertion failed: pfd\.revents & POLLIN \(src/signaler\.cpp:\d+\)$")


@pytest.mark.ray
@pytest.mark.parametrize(
    ("name", "plots"),
    [
        pytest.param(
            "quickstart",
            ["quickstart_latency.png", "quickstart_rewards.png", "quickstart_throughput.png"],
            id="quickstart",
        ),
        pytest.param("rl_loop", ["rl_loop_reward.png"], id="rl_loop"),
        pytest.param("sweep_analysis", ["sweep_pass_at_k.png", "sweep_rewards.png"], id="sweep_analysis"),
    ],
)
def test_notebook_runs_and_writes_its_plots(
    name: str, plots: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ray_session: Any
) -> None:
    book = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    assert all(not cell.get("outputs") for cell in book.cells if cell.cell_type == "code"), (
        "outputs not stripped"
    )
    out = tmp_path / "out"
    monkeypatch.setenv("GYM_RAY_NOTEBOOK_OUT", str(out))
    # The kernel joins the session's Ray instead of starting its own (seconds saved per notebook).
    monkeypatch.setenv("RAY_ADDRESS", ray_session.get_runtime_context().gcs_address)
    kernel_err = tmp_path / "kernel.stderr"
    with kernel_err.open("w") as stderr:  # the kernel process's own stderr (Ray's C++ lines go there)
        nbclient.NotebookClient(
            book, timeout=60, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        ).execute(stderr=stderr)
    cell_err = [
        output["text"]
        for cell in book.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "stream" and output.get("name") == "stderr"
    ]
    assert cell_err == []
    # What the kernel printed after the notebook ran, apart from jupyter's own warning about plain TCP.
    kernel_lines = [
        line
        for line in kernel_err.read_text().splitlines()
        if not line.startswith("[IPKernelApp] WARNING") and not _ZMQ_SHUTDOWN_ASSERT.match(line)
    ]
    assert kernel_lines == []
    for plot in plots:
        path = out / plot
        assert path.is_file(), f"{name} did not write {plot}"
        assert path.stat().st_size > 0
