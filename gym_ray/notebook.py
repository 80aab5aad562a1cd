"""Notebook helpers: the public face of :mod:`gym_ray.observe.notebook`.

Results as Arrow / pandas tables, a progress display for a cell, and plots; see that module for each.
Import them from here: ``from gym_ray.notebook import to_pandas, track``.
"""

from __future__ import annotations

from gym_ray.observe import notebook as _notebook
from gym_ray.observe.notebook import *  # noqa: F403  (exactly that module's __all__)

__all__ = list(_notebook.__all__)
