"""``gym-ray submit``: run ``gym-ray run`` on a Ray cluster as a Ray job (the Jobs API).

The job's entrypoint is ``python -m gym_ray.cli run CONFIG... [key=value ...]``; its runtime environment
ships the config files (as the job's working directory) and this gym_ray package (``py_modules``), so the
cluster runs the same code as the caller. Inside the job ``RAY_ADDRESS`` is set, so the run joins the
cluster instead of starting a Ray of its own.

What is not shipped: the input rows and the run folder. ``input_jsonl_fpath`` and ``output_dir`` must
name storage every node of the cluster sees (cluster/README.md, "Filesystem"), or ``output_dir`` an
``s3://`` folder, reached with the cluster's own AWS SDK credentials (none of the caller's is shipped).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import gym_ray
from gym_ray.errors import ConfigError, UsageError

__all__ = ["build_submission", "submit_main"]

#: Seconds between two status polls while waiting for the job.
POLL_S = 2.0
#: Seconds a just-started cluster gets to bring up its job agent ("No available agent ... try again later").
AGENT_WAIT_S = 60.0
_TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def build_submission(
    configs: list[str], overrides: list[str], *, workers: int | None, staging: Path
) -> dict[str, Any]:
    """The ``submit_job`` arguments: entrypoint and runtime_env, with the configs copied to ``staging``.

    Raises:
        ConfigError: A config file is missing, or two config files share a file name.
    """
    names: list[str] = []
    for config in configs:
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"config file '{config}' does not exist; pass the path of a YAML file")
        if path.name in names:
            raise ConfigError(
                f"two config files are named '{path.name}'; the job's working directory holds them side by "
                "side, so give them distinct names"
            )
        shutil.copy2(path, staging / path.name)
        names.append(path.name)
    command = ["python", "-m", "gym_ray.cli", "run", *names, *overrides]
    if workers is not None:
        command += ["--workers", str(workers)]
    return {
        "entrypoint": shlex.join(command),
        "runtime_env": {"working_dir": str(staging), "py_modules": [str(Path(gym_ray.__file__).parent)]},
    }


def _submit(client: Any, submission: dict[str, Any]) -> str:
    """Submit, waiting up to :data:`AGENT_WAIT_S` while the cluster says its job agent is not up yet."""
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            job_id: str = client.submit_job(**submission)
            return job_id
        except RuntimeError as exc:
            if "try again later" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(POLL_S)


def submit_main(args: argparse.Namespace) -> int:
    """``gym-ray submit CONFIG... [key=value ...] --address http://HEAD:8265``: returns the exit code.

    Prints the job id and the command that follows its logs; unless ``--no-wait``, waits for the job and
    exits 0 when it succeeded, 1 when it failed or was stopped.
    """
    from ray.job_submission import JobSubmissionClient

    configs = [c for c in args.config if "=" not in c]
    overrides = [c for c in args.config if "=" in c]
    if not configs:
        raise UsageError("no config file given; pass the YAML config(s), then any key=value overrides")
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    with tempfile.TemporaryDirectory(prefix="gym-ray-submit-") as staging:
        submission = build_submission(configs, overrides, workers=args.workers, staging=Path(staging))
        try:
            client = JobSubmissionClient(args.address)
            job_id = _submit(client, submission)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise UsageError(
                f"cannot submit to the Ray job server at {args.address} ({str(exc).splitlines()[0]}); "
                "pass the dashboard address of a running cluster, e.g. --address http://HEAD:8265"
            ) from exc
    print(f"submitted job {job_id}: {submission['entrypoint']}")
    print(f"follow its logs: ray job logs --follow --address {args.address} {job_id}")
    if args.no_wait:
        return 0
    status = str(client.get_job_status(job_id))
    while status.rsplit(".", 1)[-1] not in _TERMINAL:
        time.sleep(POLL_S)
        status = str(client.get_job_status(job_id))
    status = status.rsplit(".", 1)[-1]
    print(f"job {job_id}: {status}")
    if status != "SUCCEEDED":
        tail = client.get_job_logs(job_id).strip().splitlines()[-5:]
        for line in tail:
            print(f"  {line}")
    return 0 if status == "SUCCEEDED" else 1
