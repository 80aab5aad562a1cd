"""The first-touch memory probe every ``gym-ray bench`` scenario runs first, and how it is reported."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

from gym_ray.bench import machine
from gym_ray.bench.cli import bench_args, bench_main


def test_the_probe_times_each_page_of_fresh_memory() -> None:
    cost = machine.fresh_memory_us_per_page(8)
    assert math.isfinite(cost)
    assert cost > 0


def test_the_probe_runs_in_a_child_so_the_bench_process_keeps_its_peak_rss() -> None:
    before = _peak_kib()
    figures = machine.machine_figures()
    assert set(figures) == {"fresh_memory_us_per_page"}
    assert figures["fresh_memory_us_per_page"] > 0
    # the probe touches 256 MiB: had it run here, this process's high-water mark would have grown by that
    assert _peak_kib() - before < 16 * 1024


def _peak_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/self/status")


def test_a_cheap_machine_gets_no_warning_and_a_slow_one_gets_one_line() -> None:
    assert machine.fresh_memory_note(1.3) is None
    assert machine.fresh_memory_note(machine.SLOW_US_PER_PAGE) is None
    note = machine.fresh_memory_note(9.84)
    assert note == (
        "gym-ray bench: memory never used before costs 9.8 us per 4 KiB page on this machine (a virtual "
        "machine whose host backs memory on first use; above 3 us is slow): the figures below include it "
        "and can be several times a warm machine's. Touching the free memory once first "
        "(docs/benchmarks.md#fresh-memory) removes it"
    )
    assert "\n" not in note


def test_bench_figures_carry_the_machine_probe_and_a_slow_machine_is_named_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A fresh VM cannot be had on demand: the probe's figure is the only thing replaced here
    monkeypatch.setattr(machine, "machine_figures", lambda: {"fresh_memory_us_per_page": 9.84})
    parser = argparse.ArgumentParser()
    bench_args(parser)
    assert bench_main(parser.parse_args(["merge", "-n", "200", "--shards", "2"])) == 0
    out, err = capsys.readouterr()
    headline, _, figures = out.partition("\n{")
    assert headline.startswith("merge bench: rows=200 shards=2 ")
    result = json.loads("{" + figures)
    assert result["machine"] == {"fresh_memory_us_per_page": 9.84}
    assert result["rows"] == 200
    assert err == machine.fresh_memory_note(9.84) + "\n"


def test_a_probe_that_cannot_run_reports_none_and_the_bench_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the child exits 1 before probing
    assert machine.machine_figures() == {"fresh_memory_us_per_page": None}
