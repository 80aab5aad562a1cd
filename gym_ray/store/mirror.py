"""A run folder on an object store, worked on through a local copy that belongs to one process.

Every process of a run (the caller, the driver, each worker, the coordinator) works in a local folder of
its own, its *stage* (``$GYM_RAY_STAGE_DIR`` or the temp folder, ``gym_ray-stage/<url digest>/<pid>``),
with the same code as a local run folder. What another process needs travels through the store:

- whole files (the run's record and manifest, each shard's inputs and manifest, the outputs, metrics and
  summary) are objects named as in a local folder; a process pushes the files it wrote or changed
  (:meth:`Mirror.push_changed`) and pulls what it lacks (:meth:`Mirror.pull_files`);
- a shard's append-only files are segments committed through its head (:mod:`gym_ray.store.segments`); a
  reader rebuilds them with :meth:`Mirror.pull_shard`.

No process reads another one's stage, so nothing needs a folder every node mounts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gym_ray.errors import UsageError
from gym_ray.record.shard_files import list_shards
from gym_ray.store import is_store_url
from gym_ray.store.objects import ObjectStore, parse_store_url
from gym_ray.store.segments import SHARDS_PREFIX, published_files, read_head, restore_shard

if TYPE_CHECKING:
    from gym_ray.config.run_config import RunConfig

_R = TypeVar("_R")

__all__ = ["Mirror", "folder_copy", "localize", "mirror_of", "on_store", "release_all", "stage_root"]

#: Files a process keeps to itself: locks, line indexes, progress, journals and work folders.
_LOCAL_ONLY_SUFFIXES = (".lock", ".idx", ".progress.json", ".part", ".restore", ".tmp")
#: A run's merged files and metrics file: written by its end, never read by a run (only by status, the
#: ledger and ``gym-ray aggregate``).
RUN_OUTPUTS = frozenset({"rollouts.jsonl", "rollouts_failures.jsonl", "rollouts_aggregate_metrics.json"})
#: Files written last, in this order, so that a reader who sees them sees everything before them.
_LAST = ("run_state.json", "rollouts_summary.json")


def stage_root() -> Path:
    """Where this process's stages live: ``$GYM_RAY_STAGE_DIR``, else ``<temp>/gym_ray-stage``."""
    return Path(os.environ.get("GYM_RAY_STAGE_DIR") or Path(tempfile.gettempdir()) / "gym_ray-stage")


_MIRRORS: dict[str, Mirror] = {}


def mirror_of(url: str) -> Mirror:
    """This process's mirror of the run folder ``url`` (made, with an empty stage, on first use)."""
    mirror = _MIRRORS.get(url)
    if mirror is None:
        mirror = _MIRRORS[url] = Mirror(ObjectStore(parse_store_url(url)))
    return mirror


def release_all() -> None:
    """Remove every stage of this process (see :func:`gym_ray.store.release_stages`)."""
    while _MIRRORS:
        _MIRRORS.popitem()[1].close()


def localize(run: RunConfig) -> RunConfig:
    """``run`` as this process works on it: for a store folder, ``output_dir`` is this process's stage."""
    if run.store_url is None:
        return run
    stage = str(mirror_of(run.store_url).stage)
    if run.settings.output_dir == stage:
        return run
    return replace(run, settings=run.settings.model_copy(update={"output_dir": stage}))


def _sweep_dead(folder: Path) -> None:
    """Remove the stages in ``folder`` of processes of this machine that are gone (killed ones leave theirs;
    what counts of them is on the store)."""
    import psutil

    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return
    for entry in entries:
        pid = entry.name.split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(entry.path, ignore_errors=True)


@contextlib.contextmanager
def folder_copy(
    folder: str | os.PathLike[str], *, push: bool = False
) -> Iterator[tuple[Path, Mirror | None]]:
    """A run folder as a local path: a local folder as it is; a store folder copied into a fresh stage
    (removed on the way out). Yields ``(path, mirror)``, the mirror None for a local folder.

    Args:
        push: Upload the files changed in the copy on the way out (``gym-ray aggregate``).

    Raises:
        UsageError: The store folder holds no run (nothing under its prefix).
        StoreError: The store cannot be reached.
    """
    if not is_store_url(folder):
        yield Path(folder), None
        return
    mirror = Mirror(ObjectStore(parse_store_url(str(folder), key="run folder")))
    try:
        mirror.store.check()
        if not mirror.store.listing():
            raise UsageError(f"run folder {folder} holds nothing; pass the folder a run wrote")
        mirror.pull_all()
        yield mirror.stage, mirror
        if push:
            mirror.push_changed()
    finally:
        mirror.close()


@contextlib.asynccontextmanager
async def on_store(run: RunConfig) -> AsyncIterator[tuple[RunConfig, Callable[[Any], Any]]]:
    """Open a store folder for a run started in this process: reach the bucket, copy the folder here.

    Yields ``(local, published)``: the run config on this process's stage, and a function that turns a
    result's local paths into the store's URLs. On the way out the files this process wrote are pushed and
    its stage is removed.

    Raises:
        StoreError: The bucket cannot be reached with the SDK's credentials and endpoint.
    """
    assert run.store_url is not None
    mirror = mirror_of(run.store_url)
    try:
        await asyncio.to_thread(mirror.store.check)
        await asyncio.to_thread(lambda: mirror.pull_files(outputs=False))  # the run's record and plan
        try:
            yield localize(run), mirror.published
        finally:
            await asyncio.to_thread(mirror.push_changed)  # the run's record, on success or failure
    finally:
        _MIRRORS.pop(run.store_url, None)
        mirror.close()


class Mirror:
    """One process's stage of a store folder, and the transfers between the two."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        digest = hashlib.sha256(str(store.url).encode()).hexdigest()[:16]
        self.stage = stage_root() / digest / f"{os.getpid()}-{os.urandom(3).hex()}"
        _sweep_dead(self.stage.parent)
        self.stage.mkdir(parents=True)
        self._seen: dict[str, tuple[int, int]] = {}  # file -> (size, mtime_ns) when last pulled or pushed
        self._etags: dict[str, str] = {}  # file -> ETag of the object it came from or went to
        self._restored: dict[str, str] = {}  # shard -> ETag of the head its local files were rebuilt from

    def _stat(self, name: str) -> tuple[int, int] | None:
        try:
            st = (self.stage / name).stat()
        except FileNotFoundError:
            return None
        return st.st_size, st.st_mtime_ns

    def pull_files(self, names: list[str] | None = None, *, outputs: bool = True) -> list[str]:
        """Download whole-file objects missing here or changed on the store (all of them, or ``names``).

        ``outputs=False`` leaves out the merged files and the metrics file (:data:`RUN_OUTPUTS`), which a
        run writes anew and never reads: a resumed run does not fetch the last one's."""
        listing = {name: v for name, v in self.store.listing().items() if not name.startswith(SHARDS_PREFIX)}
        pulled = []
        for name, (_, etag) in sorted(listing.items()):
            if (names is not None and name not in names) or "/" in name or self._etags.get(name) == etag:
                continue
            if not outputs and name in RUN_OUTPUTS:
                continue
            self.store.download(name, self.stage / name)
            self._etags[name] = etag
            self._seen[name] = self._stat(name) or (0, 0)
            pulled.append(name)
        return pulled

    def pull_named(self, names: list[str]) -> None:
        """Download these whole files (one request each; a name with no object is left alone)."""
        for name in names:
            try:
                self.store.download(name, self.stage / name)
            except FileNotFoundError:
                continue
            self._seen[name] = self._stat(name) or (0, 0)

    def shards(self) -> list[str]:
        """Labels of every shard with a head on the store."""
        names = self.store.listing(SHARDS_PREFIX + "/")
        return sorted({name.split("/")[1] for name in names if name.endswith("/head.json")})

    def pull_shard(self, shard: str) -> None:
        """Rebuild one shard's append-only files here from its committed segments."""
        got = read_head(self.store, shard)
        etag = got[1] if got else ""
        if self._restored.get(shard) == etag:
            return  # this copy is that head's already (the merge ahead keeps what it read of it)
        restore_shard(self.store, self.stage, shard, got[0] if got else None)
        self._restored[shard] = etag
        for path in published_files(self.stage, shard):
            self._seen[path.name] = self._stat(path.name) or (0, 0)

    def pull_all(self, *, outputs: bool = True) -> None:
        """The whole folder: every whole file (``outputs``: as :meth:`pull_files`) and every shard's committed
        records."""
        self.pull_files(outputs=outputs)
        for shard in sorted(set(self.shards()) | set(list_shards(self.stage))):
            self.pull_shard(shard)

    def push_changed(self) -> list[str]:
        """Upload every whole file of the stage this process wrote or changed since its last pull or push."""
        shard_files = {p.name for s in list_shards(self.stage) for p in published_files(self.stage, s)}
        names = []
        for entry in os.scandir(self.stage):
            name = entry.name
            if not entry.is_file() or name.startswith(".") or name in shard_files:
                continue
            if name.endswith(_LOCAL_ONLY_SUFFIXES):
                continue
            if self._stat(name) != self._seen.get(name):
                names.append(name)
        names.sort(key=lambda n: (_LAST.index(n) if n in _LAST else -1, n))
        for name in names:
            stat = self._stat(name)
            self.store.upload(name, self.stage / name)
            self._seen[name] = stat or (0, 0)
            self._etags.pop(name, None)
        return names

    def url_of(self, path: str | os.PathLike[str] | None) -> str | None:
        """The store URL of a path in the stage (other paths and None unchanged)."""
        if path is None:
            return None
        text = str(path)
        stage = str(self.stage)
        if text == stage:
            return str(self.store.url)
        if text.startswith(stage + os.sep):
            return f"{self.store.url}/{text[len(stage) + 1 :]}"
        return text

    def published(self, result: _R) -> _R:
        """A pydantic result with every path field that points into the stage given as a store URL."""
        fields = getattr(type(result), "model_fields", {})
        update = {
            name: self.url_of(getattr(result, name))
            for name in fields
            if (name.endswith("_path") or name == "run_dir") and isinstance(getattr(result, name), str)
        }
        return result.model_copy(update=update)  # type: ignore[attr-defined, no-any-return]

    def close(self) -> None:
        """Remove the stage (the store holds everything that counts), and its URL's folder once empty."""
        shutil.rmtree(self.stage, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.stage.parent.rmdir()
