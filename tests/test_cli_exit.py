"""The exit status table of `gym-ray`: one class -> status mapping, decided by the error's MRO."""

from __future__ import annotations

import pytest

from gym_ray import cli, errors


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        pytest.param(errors.ConfigError("bad key", key="k"), 2, id="config"),
        pytest.param(errors.InputError("empty", path="x.jsonl"), 2, id="input"),
        pytest.param(errors.ResumeError("other run"), 2, id="resume"),
        pytest.param(errors.IncompleteRunError("3 failed"), 3, id="incomplete"),
        pytest.param(errors.RunRejectedError("strict"), 3, id="rejected"),
        pytest.param(errors.ServerConnectionError("down", url="http://h:1"), 1, id="server"),
        pytest.param(errors.ActorLostError("driver died", role="driver"), 1, id="actor-lost"),
        pytest.param(errors.ShardIOError("ENOSPC"), 1, id="shard-io"),
        pytest.param(OSError(28, "No space left on device"), 1, id="oserror"),
        pytest.param(errors.RunTerminated("SIGTERM"), 143, id="sigterm"),
        pytest.param(KeyboardInterrupt(), 130, id="ctrl-c"),
        pytest.param(ValueError("a bug"), None, id="not-ours"),
    ],
)
def test_each_error_gets_its_documented_exit_status(exc: BaseException, status: int | None) -> None:
    assert cli.exit_status(exc) == status


def test_a_new_subclass_takes_its_parent_status_until_it_gets_its_own_line() -> None:
    class OutageError(errors.ServerError):
        pass

    assert cli.exit_status(OutageError("down")) == 1
    cli.EXIT_STATUSES[OutageError] = 4
    try:
        assert cli.exit_status(OutageError("down")) == 4
    finally:
        del cli.EXIT_STATUSES[OutageError]


def test_every_status_in_the_table_is_documented_in_the_help() -> None:
    documented = {int(line.split()[0]) for line in cli.EXIT_STATUS_HELP.splitlines()[1:]}
    assert set(cli.EXIT_STATUSES.values()) - {143} <= documented  # 143 shares the 130 line
    assert "143 stopped by SIGTERM" in cli.EXIT_STATUS_HELP


def test_the_error_line_is_the_remote_cause_without_colour_codes() -> None:
    class WrappedByRay(Exception):  # the shape of ray.exceptions.RayTaskError: the cause in .cause
        def __init__(self, cause: BaseException) -> None:
            super().__init__("\x1b[36m(ShardDriver pid=1)\x1b[0m Traceback (most recent call last): ...")
            self.cause = cause

    cause = errors.RecordError("cannot write \x1b[31mruns/r1/rollouts.jsonl\x1b[0m: no space left")
    assert cli.error_line("run", cli._unwrap(WrappedByRay(cause))) == (
        "gym-ray run: RecordError: cannot write runs/r1/rollouts.jsonl: no space left"
    )


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        pytest.param(
            ["stauts", "runs/r1"],
            "gym-ray: error: argument COMMAND: invalid choice: 'stauts'; did you mean 'status'? (choose from "
            "run, submit, serve, status, aggregate, demo, bench)",
            id="command",
        ),
        pytest.param(
            ["bench", "pipline"],
            "gym-ray bench: error: argument scenario: invalid choice: 'pipline'; did you mean 'pipeline'? "
            "(choose from dispatch, record, ray, tracing, memory, latency, merge, tail, collect-memory, "
            "plan-memory, ray-vs-local, chaos, pipeline, store)",
            id="scenario",
        ),
        pytest.param(
            ["run", "--wrokers", "2", "config.yaml"],
            "gym-ray run: error: unrecognized argument '--wrokers'; did you mean '--workers'?",
            id="option",
        ),
        pytest.param(
            ["bench", "tail", "-n", "0"],
            "gym-ray bench: error: argument -n: '0': give an integer >= 1",
            id="bench-count",
        ),
        pytest.param(
            ["status", "runs/r1", "--zzz", "--yyy"],
            "gym-ray status: error: unrecognized argument '--zzz' (and 1 more after it) (options: --help, "
            "--json, -h)",
            id="no-close-option",
        ),
    ],
)
def test_a_misspelt_command_scenario_or_option_exits_2_with_one_did_you_mean_line(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing runs; the last stderr line names what was not understood and the closest right spelling."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == line


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == "gym-ray 0.1.0\n"


def test_run_help_says_a_folder_another_run_holds_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 30: `run --help` left "another run holds the folder" out of exit status 2 (README has it)."""
    with pytest.raises(SystemExit) as done:
        cli.main(["run", "--help"])
    assert done.value.code == 0
    assert (
        "  2    bad input, config or arguments, or another run holds the folder: nothing was dispatched\n"
        in capsys.readouterr().out
    )


def test_an_error_that_leaves_a_resumable_folder_says_so_on_its_line() -> None:
    exc = errors.ShardIOError("shard '00000': appending to runs/r1/rollouts-00000.jsonl failed: ENOSPC")
    exc.resume_hint = "the run folder runs/r1 is resumable: rerun the same command"  # type: ignore[attr-defined]
    assert cli.error_line("run", exc) == (
        "gym-ray run: ShardIOError: shard '00000': appending to runs/r1/rollouts-00000.jsonl failed: ENOSPC; "
        "the run folder runs/r1 is resumable: rerun the same command"
    )


def test_the_tail_bench_refuses_one_shard_in_one_line_before_measuring(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "tail", "--shards", "1", "-n", "100"]) == 2
    assert capsys.readouterr().err == (
        "gym-ray bench: error: --shards 1: the tail bench needs 2 or more (all but the last go ahead)\n"
    )
