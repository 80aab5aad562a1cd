"""A command's standard streams as a Unix tool's: a reader that goes away stops the printing, not the command.

``gym-ray status RUN | head -1`` closes the pipe after one line; the next write to it raises
``BrokenPipeError`` (Python ignores ``SIGPIPE``). Left alone, that error would end ``status`` with exit 1,
abort an ``aggregate`` between its merge and its metrics, or turn a completed ``run`` into a failed one.
:func:`unix_streams` wraps ``sys.stdout`` and ``sys.stderr`` for the length of one command: the first
write or flush that finds its reader gone points the stream's file descriptor at ``/dev/null`` (so what is
still buffered, and Python's own flush at exit, go nowhere without another error) and the command goes on
to its real outcome and exit status.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO, cast

__all__ = ["ReaderSafeStream", "unix_streams"]


class ReaderSafeStream:
    """A text stream whose writes and flushes never raise ``BrokenPipeError``.

    Once the reader is gone, :attr:`reader_gone` is True and the stream's file descriptor is
    ``/dev/null``: later writes succeed and are dropped. Every other attribute is the wrapped stream's.

    Args:
        stream: The stream to wrap (``sys.stdout`` or ``sys.stderr``).
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        """Write ``text``; its length, also when the reader is gone and it was dropped."""
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        """Flush; nothing when the reader is gone."""
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    def _to_devnull(self) -> None:
        self.reader_gone = True
        try:
            fd = self.stream.fileno()
        except (OSError, ValueError, io.UnsupportedOperation):
            return  # not a file (a test's capture): nothing is buffered for a descriptor
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)
        try:  # what the failed write left in the buffer now goes to /dev/null
            self.stream.flush()
        except OSError:
            pass


@contextmanager
def unix_streams() -> Iterator[tuple[ReaderSafeStream, ReaderSafeStream]]:
    """``sys.stdout`` and ``sys.stderr`` as :class:`ReaderSafeStream` inside the block (put back after)."""
    out, err = ReaderSafeStream(sys.stdout), ReaderSafeStream(sys.stderr)
    sys.stdout, sys.stderr = cast(TextIO, out), cast(TextIO, err)
    try:
        yield out, err
    finally:
        sys.stdout, sys.stderr = out.stream, err.stream
