"""What planning's validation pass learnt of each input line, handed to the planning pass: one parse per row.

Planning reads its input file twice (:mod:`gym_ray.plan.shards`); the planning pass proves that it reads
the very bytes the validation pass read (:mod:`gym_ray.plan._input_chunks`) and numbers tasks by order.
For the common line the planning pass then only needs to know what the validation pass knew already:
that the line is json's compact text of a common row (a dict naming its agent, no routing stamp, no task
or rollout index of its own, attempt 0) whose task is numbered by content, so that the planned row is the
line with its two indices appended (:data:`STAMP_AS_READ`). The validation pass writes one byte per line
(:meth:`gym_ray.plan._spill_dedupe.RangeRecorder.add_line_flags`, a ``.flags`` file next to the part's
digests); the planning pass reads them in step with its lines (:class:`LineFlags`) and parses only the
lines without the flag. A line's flag is a fact about its bytes, which the chunk check proves equal, so
the rows come out as parsing them gives (``tests/plan/test_line_flags.py`` compares both).

Memory: one read buffer (1 MiB). Disk: one byte per input line, in the dedupe's temporary folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from gym_ray._json import _DIGITS_AS_ZERO as _MARKS
from gym_ray._json import _unsure_number
from gym_ray.plan._input_chunks import changed

__all__ = ["PARSE", "STAMP_AS_READ", "LineFlags", "flags_path", "written_as_is"]

#: The line needs parsing in the planning pass (any line the flag below does not describe).
PARSE = 0
#: The line is json's compact text of a common row numbered by content, with no ``_ng_task_index`` /
#: ``_ng_rollout_index`` of its own and attempt 0: the planned row is the line with the two indices appended.
STAMP_AS_READ = 1
_READ_BYTES = 1 << 20
_DIFFER = "the rows' contents differ"


def flags_path(digests: Path) -> Path:
    """The line flags file that belongs with a part's digests file (``name.digests`` -> ``name.flags``)."""
    return digests.with_suffix(".flags")


def written_as_is(block: bytes) -> bool:
    """True when, for every row of ``block`` whose orjson text is its line, ``json``'s compact text is that
    line too: no number in the block is one ``json`` may write otherwise (an exponent, 17 or more integer
    digits, 4 or more fraction digits; :func:`gym_ray._json._unsure_number`, which tells a number from a
    look-alike in a string such as a hex id). A ``null`` needs no check here: a row read from a line whose
    orjson text is that line holds no NaN or infinity (orjson would write ``null`` where the line has
    ``NaN``), so each ``null`` is a None, which both write alike."""
    return not _unsure_number(block.translate(_MARKS))


class LineFlags:
    """The planning pass's reader of the parts' line flags files, in input order.

    Args:
        files: The parts' ``.flags`` files, in input order (together one byte per line of the input).
    """

    def __init__(self, files: list[Path]) -> None:
        self._chunks = self._read(files)
        self._held = b""
        self._at = 0  # the next flag's offset in _held
        self._left = sum(path.stat().st_size for path in files)

    @staticmethod
    def _read(files: list[Path]) -> Iterator[bytes]:
        for path in files:
            with path.open("rb") as src:
                while chunk := src.read(_READ_BYTES):
                    yield chunk

    def take(self, count: int) -> bytes:
        """The flags of the next ``count`` lines.

        Raises:
            InputError: Fewer flags are left (the file holds more lines than the validation pass read).
        """
        if count > self._left:
            raise changed(_DIFFER)
        self._left -= count
        held, at = self._held, self._at
        if at + count > len(held):  # the rest of this read, then the next ones
            held, at = held[at:], 0
            while len(held) < count:
                held += next(self._chunks)
            self._held = held
        self._at = at + count
        return held[at : at + count]

    def finish(self) -> None:
        """Check that every line the validation pass flagged was read again.

        Raises:
            InputError: The planning pass read fewer lines.
        """
        if self._left:
            raise changed(_DIFFER)
