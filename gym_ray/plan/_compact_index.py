"""Compact integer tables for state that grows with the number of distinct tasks.

Preprocessing keeps two tables for the whole input (PROTOCOL.md section 4): content digest -> task index,
so identical rows share one task, and task index -> next rollout index. As Python dicts they cost about
180 bytes per distinct task. These replacements store plain machine integers in :mod:`array` buffers:

- :class:`CompactIndex`, an insertion-ordered set of 64-bit keys numbered by position (the compact form
  of ``d.setdefault(key, len(d))``): one uint64 per key plus an open-addressing table of 32-bit positions
  kept at load <= 0.5, about 17-25 bytes per key.
- :class:`DenseCounters`, counters that start at 0 (``n = d.get(k, 0); d[k] = n + 1``): a byte per key
  for dense non-negative keys, widened only when a count outgrows it, with a dict for the other keys.

Why :mod:`array` and not numpy: single-element reads and writes from Python, which is all a lookup does,
are several times faster on ``array``, and it adds no dependency.

Nothing here is thread-safe or persisted; one owner uses a table at a time.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

from gym_ray.errors import InternalError

__all__ = ["CompactIndex", "DenseCounters"]

_U64_MAX = (1 << 64) - 1
# Fibonacci hashing: multiply by 2**64 / golden ratio and keep the top bits, so keys that share low bits
# (sequential ints, multiples of the table size) still spread over the table.
_FIB = 0x9E3779B97F4A7C15


def _typecode(itemsize: int) -> str:
    return next(code for code in "BHILQ" if array(code).itemsize == itemsize)


_U32 = _typecode(4)
_U64 = _typecode(8)
# Counter widths, narrowest first: a count moves to the next one when it no longer fits.
_WIDTHS = ("B", "H", _U32, _U64)


class CompactIndex:
    """An insertion-ordered set of unsigned 64-bit keys, each numbered by its position.

    ``index.add(key)`` behaves like ``d.setdefault(key, len(d))`` on a dict: a new key gets the next
    position (0, 1, 2, ...), a known key gets the position it got first.

    Memory: the keys in one uint64 array (8 bytes each) plus a linear-probing table of ``position + 1``
    (0 marks an empty slot) that doubles whenever more than half its slots are used, so 8-16 bytes per
    key while the table has at most 2**32 slots (64-bit slots beyond). A resize drops the old table before
    building the new one from the keys.

    Args:
        capacity: Initial table slots, a power of two >= 2. The table grows as needed; this only matters
            to avoid the first few resizes.

    Raises:
        InternalError: ``capacity`` is not a power of two >= 2.
    """

    __slots__ = ("_keys", "_mask", "_shift", "_slots")

    def __init__(self, *, capacity: int = 16) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 2:
            raise InternalError(f"CompactIndex capacity must be a power of two >= 2, got {capacity!r}")
        if capacity & (capacity - 1):
            raise InternalError(f"CompactIndex capacity must be a power of two >= 2, got {capacity!r}")
        self._keys: array[int] = array(_U64)
        self._slots: array[int] = array(_U32)
        self._mask = 0
        self._shift = 0
        self._build(capacity)

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[int]:
        """The keys in insertion order (position 0 first)."""
        return iter(self._keys)

    def __contains__(self, key: object) -> bool:
        return self.get(key) is not None

    @property
    def capacity(self) -> int:
        """The number of table slots (a power of two; more than twice ``len(self)`` once non-empty)."""
        return len(self._slots)

    def get(self, key: object) -> int | None:
        """The position of ``key``, or None when it was never added (any value that is not an int in
        ``[0, 2**64)`` included; like a dict, ``True`` and ``False`` look up 1 and 0)."""
        if not isinstance(key, int) or not 0 <= key <= _U64_MAX:
            return None
        slots, keys, mask = self._slots, self._keys, self._mask
        slot = ((key * _FIB) & _U64_MAX) >> self._shift
        while (found := slots[slot]) != 0:
            if keys[found - 1] == key:
                return found - 1
            slot = (slot + 1) & mask
        return None

    def add(self, key: int) -> int:
        """The position of ``key``, adding it at position ``len(self)`` when it is new.

        Args:
            key: An int in ``[0, 2**64)``.

        Returns:
            The key's position: ``len(self)`` before the call when the key is new.

        Raises:
            InternalError: ``key`` is not an int in ``[0, 2**64)`` (a gym_ray bug: keys are digests).
        """
        if type(key) is not int or not 0 <= key <= _U64_MAX:
            raise InternalError(f"CompactIndex keys are ints in [0, 2**64), got {key!r}")
        slots, keys, mask = self._slots, self._keys, self._mask
        slot = ((key * _FIB) & _U64_MAX) >> self._shift
        while (found := slots[slot]) != 0:
            if keys[found - 1] == key:
                return found - 1
            slot = (slot + 1) & mask
        position = len(keys)
        keys.append(key)
        slots[slot] = position + 1
        if 2 * (position + 1) > len(slots):
            self._build(2 * len(slots))
        return position

    def _build(self, capacity: int) -> None:
        """Replace the table with one of ``capacity`` slots holding every key."""
        # Release the old table first: rebuilding needs only the keys, so the peak is one table, not two.
        self._slots = array(_U32)
        slots = array(_U32 if capacity <= 1 << 32 else _U64, [0]) * capacity
        mask = capacity - 1
        shift = 64 - (capacity.bit_length() - 1)
        for position, key in enumerate(self._keys, 1):
            slot = ((key * _FIB) & _U64_MAX) >> shift
            while slots[slot]:
                slot = (slot + 1) & mask
            slots[slot] = position
        self._slots, self._mask, self._shift = slots, mask, shift


class DenseCounters:
    """Per-key counters that start at 0, compact for dense non-negative int keys.

    ``counters.take(key)`` behaves like ``n = d.get(key, 0); d[key] = n + 1; return n`` on a dict.

    Keys ``0 .. len(dense) - 1`` live in one array of the narrowest unsigned width that holds every count
    (1 byte, widened to 2, 4, 8 bytes when a count outgrows it). The dense range grows (doubling, at least
    to ``min_dense``) only to cover a key below twice its size, and only while at least half of it is in
    use, so it stays within ``max(min_dense, 4 * keys stored)`` slots; every other key (negative, huge,
    sparse) goes to a dict and moves into the array when the dense range grows over it.

    Args:
        min_dense: The first dense range, in keys.

    Raises:
        InternalError: ``min_dense`` is not an int >= 1.
    """

    __slots__ = ("_counts", "_min_dense", "_sparse", "_used")

    def __init__(self, *, min_dense: int = 1024) -> None:
        if isinstance(min_dense, bool) or not isinstance(min_dense, int) or min_dense < 1:
            raise InternalError(f"DenseCounters min_dense must be an int >= 1, got {min_dense!r}")
        self._min_dense = min_dense
        self._counts: array[int] = array("B")
        self._sparse: dict[int, int] = {}
        self._used = 0  # dense keys with a non-zero count

    def __len__(self) -> int:
        """The number of keys taken at least once."""
        return self._used + len(self._sparse)

    @property
    def dense_size(self) -> int:
        """How many keys (``0 .. dense_size - 1``) the array covers."""
        return len(self._counts)

    def get(self, key: int) -> int:
        """How many times ``key`` was taken (0 when never)."""
        if 0 <= key < len(self._counts):
            return self._counts[key]
        return self._sparse.get(key, 0)

    def take(self, key: int) -> int:
        """Return the count of ``key`` (0 the first time), then add one to it.

        Args:
            key: Any int; non-negative keys that come densely are the cheap ones.

        Returns:
            The number of earlier calls with this key.

        Raises:
            InternalError: The count would pass 2**64 - 1 (unreachable in practice).
        """
        counts = self._counts
        if 0 <= key < len(counts):
            count = counts[key]
            if count == 0:
                self._used += 1
            try:
                counts[key] = count + 1
            except OverflowError:
                self._widen(count + 1)
                self._counts[key] = count + 1
            return count
        if 0 <= key < max(2 * len(counts), self._min_dense) and 2 * self._used >= len(counts):
            self._grow()
            return self.take(key)
        count = self._sparse.get(key, 0)
        self._sparse[key] = count + 1
        return count

    def _grow(self) -> None:
        """Double the dense range (at least to ``min_dense``) and move the dict keys it now covers."""
        size = max(2 * len(self._counts), self._min_dense)
        self._counts.extend(array(self._counts.typecode, [0]) * (size - len(self._counts)))
        moved = [key for key in self._sparse if 0 <= key < size]
        for key in moved:
            count = self._sparse.pop(key)
            self._widen(count)
            self._counts[key] = count
        self._used += len(moved)

    def _widen(self, count: int) -> None:
        """Widen the array until it holds ``count``."""
        for code in _WIDTHS[_WIDTHS.index(self._counts.typecode) :]:
            if count < 1 << (8 * array(code).itemsize):
                if code != self._counts.typecode:
                    self._counts = array(code, self._counts)
                return
        raise InternalError(f"a DenseCounters count reached {count}, past the 64-bit limit")
