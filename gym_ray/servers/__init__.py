"""gym_ray's reference servers: a head server, an example environment and a verifier, with faults.

They are the demo's environment and the test tool every other module's tests use::

    async with serve_config(load_bundled_config()) as deployment:
        ...  # deployment.head_url, deployment.url_of("arith_env"), deployment.stats("arith_env")

Modules: ``launch`` (``serve_config``, ``start_in_thread``, ``gym-ray serve``), ``head``,
``example_env`` (``/run``), ``example_resources`` (``/verify``), ``metrics``
(``compute_aggregate_metrics``), ``policy`` (the simulated solver), ``faults``, ``stats``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gym_ray.servers.launch import Deployment, ThreadedDeployment, serve_config, start_in_thread
from gym_ray.servers.metrics import compute_aggregate_metrics
from gym_ray.servers.stats import ServerStats

_PACKAGE_DIR = Path(__file__).resolve().parent.parent

__all__ = [
    "Deployment",
    "ServerStats",
    "ThreadedDeployment",
    "bundled_config_path",
    "bundled_dataset_path",
    "calc_config",
    "calc_rows",
    "compute_aggregate_metrics",
    "load_bundled_config",
    "serve_config",
    "start_in_thread",
]


def bundled_dataset_path(name: str = "arithmetic") -> Path:
    """Absolute path of a bundled JSONL dataset (``gym_ray/servers/data/<name>.jsonl``)."""
    return _PACKAGE_DIR / "servers" / "data" / f"{name}.jsonl"


def bundled_config_path(name: str = "demo") -> Path:
    """Absolute path of a bundled config (``gym_ray/configs/<name>.yaml``).

    Dataset paths inside a bundled config are relative to the config file; ``load_bundled_config``
    makes them absolute.
    """
    return _PACKAGE_DIR / "configs" / f"{name}.yaml"


def load_bundled_config(name: str = "demo") -> dict[str, Any]:
    """A bundled config as a plain dict, with every relative ``datasets[].jsonl_fpath`` made absolute."""
    import yaml

    path = bundled_config_path(name)
    cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    for value in cfg.values():
        for inner in value.values() if isinstance(value, dict) else ():
            for fields in inner.values() if isinstance(inner, dict) else ():
                datasets = fields.get("datasets") if isinstance(fields, dict) else None
                for entry in datasets if isinstance(datasets, list) else ():
                    fpath = entry.get("jsonl_fpath") if isinstance(entry, dict) else None
                    if isinstance(fpath, str) and not Path(fpath).is_absolute():
                        entry["jsonl_fpath"] = str((path.parent / fpath).resolve())
    return dict(cfg)


def calc_config(**env_fields: Any) -> dict[str, Any]:
    """The smallest deployment: a head, one agent ``calc_agent`` and one environment server ``calc_env``.

    Every port is 0 (:func:`serve_config` picks them). ``env_fields`` are set on ``calc_env``'s
    ``example_env`` block (``seed``, ``latency_ms``, ``latency_jitter_ms``, ``faults``, ...). A test tool.

    Example:
        >>> async with serve_config(calc_config(seed=3, latency_ms=0)) as deployment:  # doctest: +SKIP
        ...     ...
    """
    env: dict[str, Any] = {"host": "127.0.0.1", "port": 0, **env_fields}
    env["agent_server"] = {"type": "responses_api_agents", "name": "calc_agent"}
    return {
        "head_server": {"host": "127.0.0.1", "port": 0},
        "calc_agent": {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 0}}},
        "calc_env": {"environment_servers": {"example_env": env}},
    }


def calc_rows(n: int) -> list[dict[str, Any]]:
    """``n`` distinct rows for :func:`calc_config`'s ``calc_agent``: row ``i`` asks "What is i + 1?"."""
    return [
        {
            "responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 1?"}]},
            "expected_answer": str(i + 1),
            "agent_ref": {"name": "calc_agent"},
        }
        for i in range(n)
    ]
