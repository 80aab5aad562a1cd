"""The shard writer: one locked, append-only writer per shard of a run folder (PROTOCOL.md section 5).

Files of shard ``<s>`` in ``<run_dir>``::

    rollouts-<s>.jsonl                      successes, one record per line
    rollouts-<s>_failures.jsonl             failure records, one per attempt (and omitted rows, on request)
    rollouts-<s>_materialized_inputs.jsonl  the shard's rows, replaced atomically
    rollouts-<s>.manifest.json              :class:`ShardManifest`, replaced atomically
    rollouts-<s>.progress.json              :class:`ShardProgress`, replaced atomically
    rollouts-<s>.lock                       never unlinked or replaced; holds the last opener's token
    rollouts-<s>.jsonl.idx, rollouts-<s>_failures.jsonl.idx
                                            line indexes for the merge (:mod:`gym_ray.record.line_index`)
    rollouts-<s>.attempts.log               attempts announced before they are sent
                                            (:mod:`gym_ray.record.attempt_log`), created on first use

Durability and concurrency promises:

- **The last opener holds the shard.** :meth:`ShardWriter.open` takes an exclusive ``flock`` on the lock
  file, writes a fresh random token into it (in place, fsynced; the file is never unlinked or replaced)
  and repairs torn tails, then releases the lock. Opening never waits for or refuses an older writer: it
  takes the shard over. Every later write (append, attempt announcement, progress, materialized inputs,
  manifest, and the fsync of :meth:`~ShardWriter.checkpoint` / :meth:`~ShardWriter.close`) takes the
  lock again and first checks that the token is still its own; a writer whose shard was opened by
  another writer since gets :class:`~gym_ray.errors.ShardLockError` (naming the shard and the new
  holder's pid and host) and writes nothing, then and on every later write (it is *stale*;
  :meth:`~ShardWriter.close` of a stale writer only closes its files). So a zombie writer (a worker
  frozen or partitioned while its shard was handed to another) can never interleave lines with the
  shard's new holder, in this process or another. The new holder fsyncs both record files at its first
  checkpoint, so lines an older writer left unsynced become durable too.
- **Whole lines.** Each record is one ``os.write`` of a complete line to an ``O_APPEND`` descriptor, under
  the lock (a short write is continued; a failed one fails the shard). A line written is in the page
  cache and survives a ``kill -9`` of any process.
- **Checkpoints.** Files are fsynced every ``fsync_every`` records, on :meth:`~ShardWriter.checkpoint`
  and on :meth:`~ShardWriter.close`. A power loss can lose records after the last fsync and leave a torn
  tail, which the next :meth:`~ShardWriter.open` repairs (see :mod:`gym_ray.record.jsonl`); corrupt lines
  anywhere else are moved to a quarantine file by the same open (:mod:`gym_ray.record.quarantine`), so
  their rollouts count as missing and run again.
- **Line index.** Beside each record file the writer appends an index batch at checkpoints (under the
  lock, after the lines it covers, fsynced with them; a sync that ``fsync_every`` triggers writes a file's
  batch once it holds 64 lines, :meth:`~ShardWriter.checkpoint` and :meth:`~ShardWriter.close` write any),
  so the merge can key lines without parsing them.
  The merge verifies every batch against the lines by CRC and parses whatever is not covered, so the
  index never decides what a line holds. The open's repairs drop the batches they make stale.
- **Fail, never retry.** A failed write or fsync raises :class:`~gym_ray.errors.ShardIOError` and fails
  the shard: later appends raise too and no fsync is attempted again (after a failed fsync the kernel may
  have dropped the dirty pages). Resume with a new writer once the cause is fixed.

Accepted trade-offs: a writer object is meant for one thread or event loop (its counters are not
guarded; its writes are); :meth:`~ShardWriter.append` is synchronous (an flock + pread + write, a few
microseconds; plus an fsync every ``fsync_every`` records); the lock is advisory and local-filesystem
``flock`` semantics are assumed (NFS without lock support does not exclude writers).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from gym_ray import keys
from gym_ray.errors import ConfigError, ShardIOError, ShardLockError, UsageError
from gym_ray.record.atomic import atomic_write_bytes, atomic_writer, fsync_dir
from gym_ray.record.attempt_log import Attempt, encode_batch
from gym_ray.record.jsonl import JsonlReader, encode_line, repair_torn_tail
from gym_ray.record.line_index import IndexBatch, index_path, trim_index
from gym_ray.record.manifest import ShardManifest, ShardProgress
from gym_ray.record.quarantine import quarantine_corrupt_lines
from gym_ray.record.shard_files import (
    Identity,
    ShardLock,
    record_identity,
    shard_paths,
)

__all__ = ["ShardWriter"]

_APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
#: Fewest lines of a record file whose index batch an append-driven sync writes; checkpoint() and close()
#: write any pending batch.
_INDEX_MIN_LINES = 64


class ShardWriter:
    """The locked, append-only writer of one shard (see the module docstring for the promises).

    Example:
        >>> with ShardWriter(run_dir, "shard-0000", run_id="run-1", config_identity=None) as writer:
        ...     writer.write_materialized_inputs(rows)
        ...     writer.write_manifest(build_manifest(run_dir, "shard-0000", run_id="run-1",
        ...                                          config_identity=None))
        ...     for record in records:
        ...         writer.append(record)
        ...     writer.write_progress()  # doctest: +SKIP
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        shard: str,
        *,
        run_id: str,
        config_identity: str | None,
        fsync_every: int = 256,
        record_omitted_rollouts: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Prepare a writer; nothing is touched until :meth:`open`.

        Args:
            run_dir: The run folder (created on open if missing).
            shard: The shard label (see :func:`validate_shard_label`).
            run_id: The run's id, written into the lock token, manifest and progress.
            config_identity: The config identity digest, or None.
            fsync_every: Fsync after this many appended records (>= 1).
            record_omitted_rollouts: Write rows marked ``_ng_no_persist`` (drained) to the failures
                sidecar instead of dropping them. Resume, merge and the ledger ignore such rows.
            clock: Source of timestamps.

        Raises:
            ConfigError: The label or ``fsync_every`` is invalid.
        """
        self.paths = shard_paths(run_dir, shard)
        if type(fsync_every) is not int or fsync_every < 1:
            raise ConfigError(
                f"fsync_every={fsync_every!r} must be an integer >= 1 (1 = fsync every record)",
                key="fsync_every",
            )
        self.shard = shard
        self.run_id = run_id
        self.config_identity = config_identity
        self.fsync_every = fsync_every
        self.record_omitted_rollouts = record_omitted_rollouts
        self._clock = clock
        self._lock = ShardLock(self.paths.lock)
        self._state = "new"
        self._failure: str | None = None
        self._stale_error: ShardLockError | None = None
        self._wrote = False  # any write of this writer's own since open (not only inherited unsynced lines)
        self._token = b""
        self._fds: dict[Path, int] = {}
        self._batches: dict[Path, IndexBatch] = {}  # record file -> its pending index batch
        self._dirty: set[Path] = set()
        self._since_sync = 0
        self._planned: int | None = None
        self._count_planned = False  # the inputs file existed at open: count its rows when first asked
        self._succeeded: set[Identity] = set()
        self._unkeyed_successes = 0
        self._failed: Counter[str] = Counter()
        self._terminal = 0
        self._omitted = 0
        self._attempts = 0

    # --- lifecycle ------------------------------------------------------------------------------

    def open(self) -> ShardWriter:
        """Take ownership of the shard: lock, write a fresh token, repair torn tails, release.

        Returns:
            self.

        Raises:
            UsageError: The writer was already opened.
            ShardIOError: A file could not be opened, repaired or synced.
        """
        if self._state != "new":
            raise UsageError(f"ShardWriter for shard {self.shard!r} is {self._state}; create a new writer")
        self._state = "open"
        try:
            self.paths.run_dir.mkdir(parents=True, exist_ok=True)
            self._lock.open()
            self._token = self._make_token()
            with self._lock.held():
                self._lock.write_token(self._token)
                for path in (self.paths.successes, self.paths.failures):
                    trim_index(path, rewritten=self._repair(path))
                    fd = self._fds[path] = os.open(path, _APPEND_FLAGS, 0o644)
                    self._dirty.add(path)  # an older writer's unsynced lines: ours to make durable now
                    self._fds[index_path(path)] = os.open(index_path(path), _APPEND_FLAGS, 0o644)
                    self._batches[path] = IndexBatch(os.fstat(fd).st_size)
                if self.paths.attempt_log.exists():
                    self._repair_log()
                fsync_dir(self.paths.run_dir)
                self._seed_counts()
        except OSError as exc:
            self._close_fds()
            self._state = "failed"
            raise ShardIOError(
                f"shard {self.shard!r}: opening in {self.paths.run_dir} failed ({exc}); check the folder's "
                "permissions and free space"
            ) from exc
        return self

    def __enter__(self) -> ShardWriter:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Fsync what is unsynced (unless the shard failed or was taken over), close every file. Idempotent.

        Raises:
            ShardLockError: Another writer opened the shard since and this writer had written to it; its
                unsynced writes are not fsynced by this writer (the new holder does), the files are closed
                anyway. A writer taken over before it wrote anything closes quietly.
            ShardIOError: The final fsync failed (files are closed anyway and the shard is failed).
        """
        if self._state in ("new", "closed"):
            self._state = "closed"
            return
        try:
            if self._state == "open" and (self._dirty or any(b.pending for b in self._batches.values())):
                try:
                    with self._owned("fsync"):
                        self._write_index()
                except ShardLockError:
                    if self._wrote:
                        raise
                    return  # taken over before it wrote anything: nothing of its own to sync or lose
                self._sync()
        finally:
            self._close_fds()
            if self._state in ("open", "stale"):
                self._state = "closed"

    # --- writes ---------------------------------------------------------------------------------

    def append(self, record: dict[str, Any]) -> Path | None:
        """Append one finished rollout's record to the file its kind routes it to.

        Routing: ``_ng_failure_class`` ``kill_shaped`` -> never written (None: resume reruns it);
        ``_ng_no_persist`` true -> not written (None), or the failures sidecar with
        ``record_omitted_rollouts``; ``_ng_failure_class`` set -> the failures sidecar; else successes.
        A row not written still counts as omitted in :meth:`progress`.

        Returns:
            The file written, or None for an omitted row not kept.

        Raises:
            UsageError: The writer is not open, or the record is not a JSON-serializable dict.
            ShardLockError: Another writer opened the shard since this one did; nothing was written.
            ShardIOError: The write or fsync failed, now or earlier; the shard is failed.
        """
        self._require_open()
        if not isinstance(record, dict):
            raise UsageError(f"shard {self.shard!r}: a record must be a dict, got {type(record).__name__}")
        omitted = bool(record.get(keys.NO_PERSIST))
        failure_class = record.get(keys.FAILURE_CLASS)
        if failure_class == keys.FailureClass.KILL_SHAPED or (omitted and not self.record_omitted_rollouts):
            self._omitted += 1
            return None
        path = self.paths.failures if omitted or failure_class is not None else self.paths.successes
        line = self._encode(record)
        due = self._since_sync + 1 >= self.fsync_every
        with self._owned("append to"):
            self._write_all(path, line)
            self._batches[path].note(line, record)
            if due:
                self._write_index(_INDEX_MIN_LINES)
        self._count(record, omitted=omitted, failure_class=failure_class)
        self._since_sync += 1
        if due:
            self._sync()
        return path

    def checkpoint(self) -> None:
        """Fsync every file written since the last sync, now.

        Raises:
            UsageError: The writer is not open.
            ShardLockError: Another writer opened the shard since this one did; nothing was synced.
            ShardIOError: The fsync failed, now or earlier; the shard is failed.
        """
        self._require_open()
        with self._owned("fsync"):
            self._write_index()
        self._sync()

    def announce_attempts(self, attempts: Sequence[Attempt]) -> None:
        """Append one line naming requests about to be sent to the shard's attempt log, and fsync it.

        Call it before the requests leave (:class:`~gym_ray.record.attempt_log.AttemptAnnouncer` does):
        a later owner of the shard then sends those rollouts with a higher attempt index, even when this
        writer never records their results.

        Args:
            attempts: ``(task_index, rollout_index, attempt_index)`` of each request.

        Raises:
            UsageError: The writer is not open.
            ShardLockError: Another writer opened the shard since; nothing was written: send nothing.
            ShardIOError: The write or fsync failed; the shard is failed.
        """
        self._require_open()
        if not attempts:
            return
        path = self.paths.attempt_log
        line = encode_batch(attempts)
        with self._owned("announce attempts to"):
            created = path not in self._fds
            if created:
                try:
                    self._fds[path] = os.open(path, _APPEND_FLAGS, 0o644)
                except OSError as exc:
                    raise self._fail(f"opening {path}", exc) from exc
            self._write_all(path, line)
        try:
            os.fsync(self._fds[path])
            if created:
                fsync_dir(self.paths.run_dir)
        except OSError as exc:
            raise self._fail(f"fsync of {path}", exc) from exc
        self._dirty.discard(path)

    def write_materialized_inputs(self, rows: Iterable[dict[str, Any]]) -> str:
        """Replace the shard's materialized inputs with ``rows`` atomically, one line each, in order.

        Returns:
            The sha256 hex digest of the file written (the manifest's ``inputs_digest``).

        Raises:
            UsageError: A row is not a JSON-serializable dict (names the row number); nothing is replaced.
            ShardLockError: Another writer owns the shard now.
            ShardIOError: Writing failed; the shard is failed.
        """
        self._require_open()
        digest = hashlib.sha256()
        count = 0
        with self._owned("write the materialized inputs of"):
            try:
                with atomic_writer(self.paths.materialized_inputs) as handle:
                    for count, row in enumerate(rows, start=1):
                        if not isinstance(row, dict):
                            raise UsageError(
                                f"shard {self.shard!r}: materialized row {count} is a "
                                f"{type(row).__name__}, not a dict"
                            )
                        line = self._encode(row, what=f"materialized row {count}")
                        digest.update(line)
                        handle.write(line)
            except OSError as exc:
                raise self._fail(f"writing {self.paths.materialized_inputs}", exc) from exc
        self._planned, self._count_planned = count, False
        return digest.hexdigest()

    def write_manifest(self, manifest: ShardManifest) -> None:
        """Replace the shard's manifest atomically.

        Raises:
            UsageError: The manifest names another run or shard.
            ShardLockError: Another writer owns the shard now.
            ShardIOError: Writing failed; the shard is failed.
        """
        self._require_open()
        if manifest.shard != self.shard or manifest.run_id != self.run_id:
            raise UsageError(
                f"manifest for run {manifest.run_id!r} shard {manifest.shard!r} given to the writer of run "
                f"{self.run_id!r} shard {self.shard!r}; build it with this run id and shard"
            )
        self._replace(self.paths.manifest, manifest.model_dump_json(indent=2).encode() + b"\n")

    def progress(self) -> ShardProgress:
        """The shard's counts as they stand (what :meth:`write_progress` writes)."""
        if self._count_planned:
            # Counted on first use, not at open: opening to write a manifest or append never needs it.
            self._planned = sum(1 for _ in JsonlReader(self.paths.materialized_inputs))
            self._count_planned = False
        return ShardProgress(
            run_id=self.run_id,
            shard=self.shard,
            planned=self._planned,
            succeeded=len(self._succeeded) + self._unkeyed_successes,
            failed=dict(sorted(self._failed.items())),
            terminal_failed=self._terminal,
            omitted=self._omitted,
            attempts=self._attempts,
            updated_at=self._clock(),
        )

    def write_progress(self) -> ShardProgress:
        """Replace the progress file atomically with :meth:`progress`, and return it.

        Raises:
            ShardLockError: Another writer owns the shard now.
            ShardIOError: Writing failed; the shard is failed.
        """
        self._require_open()
        progress = self.progress()
        self._replace(self.paths.progress, progress.model_dump_json(indent=2).encode() + b"\n")
        return progress

    # --- internals ------------------------------------------------------------------------------

    def _make_token(self) -> bytes:
        info = {
            "token": secrets.token_hex(16),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "run_id": self.run_id,
            "opened_at": self._clock(),
        }
        return json.dumps(info, separators=(",", ":")).encode() + b"\n"

    def _require_open(self) -> None:
        if self._state == "stale" and self._stale_error is not None:
            raise ShardLockError(
                str(self._stale_error),
                shard=self.shard,
                holder_pid=self._stale_error.holder_pid,
                holder_host=self._stale_error.holder_host,
            )
        if self._state == "failed":
            raise ShardIOError(
                f"shard {self.shard!r} is failed ({self._failure}); it takes no more writes. Fix the cause "
                "(free space, disk errors), then resume the shard with a new writer"
            )
        if self._state != "open":
            raise UsageError(f"ShardWriter for shard {self.shard!r} is {self._state}; open() it first")

    @contextlib.contextmanager
    def _owned(self, action: str) -> Iterator[None]:
        """Hold the lock for one write, after checking the lock file still holds this writer's token."""
        with self._lock.held():
            current = self._lock.read_token(len(self._token) + 1)
            if current != self._token:
                # the short read only compares; the new holder's token may be longer than this one's
                raise self._stale(action, self._lock.read_token())
            if action != "fsync":
                self._wrote = True
            yield

    def _stale(self, action: str, current: bytes) -> ShardLockError:
        """Mark this writer stale (no more writes, no fsync) and build the error naming the new holder."""
        pid, host = _holder_of(current)
        where = f"pid {pid} on {host}" if pid is not None or host is not None else "its token is unreadable"
        error = ShardLockError(
            f"shard {self.shard!r} was opened by another writer since this writer opened it; this "
            f"writer can no longer {action} it (a newer worker owns it: {where}) and wrote nothing. "
            f"Stop this writer; the holder resumes the shard in {self.paths.run_dir}",
            shard=self.shard,
            holder_pid=pid,
            holder_host=host,
        )
        self._state = "stale"
        self._stale_error = error
        self._dirty.clear()
        return error

    def _encode(self, record: dict[str, Any], *, what: str | None = None) -> bytes:
        try:
            return encode_line(record)
        except (TypeError, ValueError) as exc:
            name = what or (
                f"record {record.get(keys.TASK_INDEX)!r}-{record.get(keys.ROLLOUT_INDEX)!r} (task-rollout)"
            )
            raise UsageError(
                f"shard {self.shard!r}: {name} cannot be written as JSON ({exc}); keep records to "
                "JSON types (dict, list, str, int, float, bool, None)"
            ) from exc

    def _write_all(self, path: Path, line: bytes) -> None:
        fd = self._fds[path]
        view = memoryview(line)
        try:
            while view:
                written = os.write(fd, view)
                view = view[written:]
        except OSError as exc:
            raise self._fail(f"appending to {path}", exc) from exc
        finally:
            self._dirty.add(path)

    def _write_index(self, min_lines: int = 1) -> None:
        """Append each record file's pending index batch of at least ``min_lines`` lines to its index (call
        holding the lock). A smaller batch waits for a later checkpoint: with a small ``fsync_every`` the
        index is written (and fsynced) every ``_INDEX_MIN_LINES`` records, not on every sync."""
        for path, batch in self._batches.items():
            if batch.pending < min_lines:
                continue
            data = batch.take()
            if data:
                self._write_all(index_path(path), data)

    def _sync(self) -> None:
        for path in sorted(self._dirty):
            try:
                os.fsync(self._fds[path])
            except OSError as exc:
                raise self._fail(f"fsync of {path}", exc) from exc
            self._dirty.discard(path)
        self._since_sync = 0

    def _replace(self, path: Path, data: bytes) -> None:
        with self._owned("write"):
            try:
                atomic_write_bytes(path, data)
            except OSError as exc:
                raise self._fail(f"writing {path}", exc) from exc

    def _fail(self, what: str, exc: OSError) -> ShardIOError:
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        self._failure = f"{what} failed: {code} {exc.strerror or exc}"
        self._state = "failed"
        return ShardIOError(
            f"shard {self.shard!r}: {self._failure}. The shard is failed and takes no more writes; fsync is "
            "not retried. Fix the cause (free space, disk errors), then resume the shard with a new writer"
        )

    def _repair(self, path: Path) -> bool:
        """Repair ``path``'s torn tail and quarantine its corrupt lines; True when its index cannot be kept
        in part: lines were moved out of its middle (every later offset may have changed), or it is
        missing."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return True
        try:
            repair_torn_tail(fd, label=str(path))
        finally:
            os.close(fd)
        # Corrupt lines mid-file: moved to <file>.quarantine so the ledger clears and resume reruns them.
        return quarantine_corrupt_lines(path) > 0

    def _repair_log(self) -> None:
        """Drop a torn last line of the attempt log (a crash mid-write; its rows were never sent)."""
        fd = os.open(self.paths.attempt_log, os.O_RDWR | os.O_CLOEXEC)
        try:
            repair_torn_tail(fd, label=str(self.paths.attempt_log))
        finally:
            os.close(fd)

    def _seed_counts(self) -> None:
        for _, record in JsonlReader(self.paths.successes):
            self._count(record, omitted=False, failure_class=None)
        for _, record in JsonlReader(self.paths.failures):
            failure_class = record.get(keys.FAILURE_CLASS)
            self._count(record, omitted=bool(record.get(keys.NO_PERSIST)), failure_class=failure_class)
        self._count_planned = self.paths.materialized_inputs.exists()

    def _count(self, record: dict[str, Any], *, omitted: bool, failure_class: Any) -> None:
        if omitted:
            self._omitted += 1
            return
        self._attempts += 1
        if failure_class is None:
            identity = record_identity(record)
            if identity is None:
                self._unkeyed_successes += 1
            else:
                self._succeeded.add(identity)
            return
        self._failed[str(failure_class)] += 1
        if record.get(keys.FAILURE_TERMINAL) is True:
            self._terminal += 1

    def _close_fds(self) -> None:
        fds = list(self._fds.values())
        self._fds.clear()
        self._batches.clear()
        self._dirty.clear()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._lock.close()


def _holder_of(token: bytes) -> tuple[int | None, str | None]:
    """The ``(pid, host)`` a lock file's token names, None where it cannot be read."""
    try:
        info = json.loads(token)
    except ValueError:
        return None, None
    if not isinstance(info, dict):
        return None, None
    pid, host = info.get("pid"), info.get("host")
    return (pid if type(pid) is int else None), (host if isinstance(host, str) else None)
