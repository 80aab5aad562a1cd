"""A worker's side of a shard on an object store: take it, then publish its new lines as it runs.

Publication cadence: every ``store_publish_every`` records or ``store_publish_interval_s`` seconds,
whichever comes first, and once when the shard ends (also when it ends in an error or is stopped by
Ctrl-C or SIGTERM, so that what was recorded need not run again; a SIGKILL loses what was recorded since
the last publication, which then runs again). Each publication is two requests (the segment, then the
head), so a shard costs about ``2 * records / store_publish_every + 6`` requests in all.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from gym_ray.config.run_config import RunConfig
from gym_ray.errors import ShardLockError
from gym_ray.plan.shards import ShardSpec
from gym_ray.record.shard_files import shard_paths
from gym_ray.store.mirror import mirror_of
from gym_ray.store.objects import StoreError
from gym_ray.store.segments import ShardLease

__all__ = ["ShardPublisher", "take_shard"]


class ShardPublisher:
    """Publishes a :class:`ShardLease`'s new lines on a cadence, from a thread (the loop goes on)."""

    def __init__(self, lease: ShardLease, *, every: int, interval_s: float) -> None:
        self.lease = lease
        self._every = every
        self._interval_s = interval_s
        self._since = 0
        self._last = time.monotonic()

    def due(self) -> bool:
        """Count one record; True when a publication is due."""
        self._since += 1
        return self._since >= self._every or time.monotonic() - self._last >= self._interval_s

    async def publish(self, *, quiet: bool = False) -> None:
        """Publish now. ``quiet``: on a shard's error path, a failure to publish is logged by the caller's
        error, not raised (the shard's own error is the one to see).

        Raises:
            ShardLockError: The shard was taken on the store by another owner (this writer is a zombie).
            StoreError: The store could not be written.
        """
        self._since = 0
        self._last = time.monotonic()
        try:
            await asyncio.to_thread(self.lease.publish)
        except (ShardLockError, StoreError):
            if not quiet:
                raise


async def take_shard(run: RunConfig, spec: ShardSpec) -> tuple[ShardSpec, ShardPublisher]:
    """Take ``spec``'s shard on the store and copy it into this process's stage (inputs, manifest, the
    committed records and attempt log); returns the spec on the stage and the shard's publisher.

    Raises:
        StoreError: The store could not be read or written.
    """
    assert run.store_url is not None
    mirror = mirror_of(run.store_url)
    local = replace(spec, run_dir=str(mirror.stage))
    paths = shard_paths(mirror.stage, spec.shard)

    def take() -> ShardLease:
        if paths.materialized_inputs.exists():
            mirror.push_changed()  # planned in this process (no Ray): the plan goes up before any record
        else:
            mirror.pull_named([paths.materialized_inputs.name, paths.manifest.name])
        return ShardLease(mirror.store, mirror.stage, spec.shard).take()

    lease = await asyncio.to_thread(take)
    settings = run.settings
    every, interval = settings.store_publish_every, settings.store_publish_interval_s
    return local, ShardPublisher(lease, every=every, interval_s=interval)
