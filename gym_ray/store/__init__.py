"""Run folders on object storage (``output_dir=s3://BUCKET/PREFIX``): see :mod:`gym_ray.store.mirror`.

This package's modules import boto3 only when a store folder is used; importing the package costs nothing.
"""

from __future__ import annotations

import sys

__all__ = ["is_store_url", "release_stages"]


def is_store_url(value: object) -> bool:
    """True for a string naming a folder on an object store (``s3://...``), not a local path."""
    return isinstance(value, str) and "://" in value


def release_stages() -> None:
    """Remove this process's local copies of store folders (a no-op unless one was made): the end of an
    actor of a store run. What counts is on the store already."""
    mirror = sys.modules.get("gym_ray.store.mirror")
    if mirror is not None:
        mirror.release_all()
