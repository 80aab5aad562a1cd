"""Notebook helpers, the public face of :mod:`gym_ray.observe.notebook` (``from gym_ray.notebook import
...``).

Results as Arrow / pandas tables, a progress display for a cell, and plots; see that module for each.
"""

from __future__ import annotations

from gym_ray.observe.notebook import (
    Progress,
    load_metrics,
    load_run,
    pass_at_k_curves,
    plot_latency_histogram,
    plot_pass_at_k,
    plot_reward_distribution,
    plot_throughput,
    to_arrow,
    to_pandas,
    track,
)

__all__ = [
    "Progress",
    "load_metrics",
    "load_run",
    "pass_at_k_curves",
    "plot_latency_histogram",
    "plot_pass_at_k",
    "plot_reward_distribution",
    "plot_throughput",
    "to_arrow",
    "to_pandas",
    "track",
]
