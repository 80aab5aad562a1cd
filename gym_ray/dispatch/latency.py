"""A mergeable latency histogram: fixed log-spaced buckets, so shards' histograms add up exactly.

Each bucket spans a factor of 1.1, so a quantile read from the histogram is within 10% of the exact one;
the histogram is 200 integers however many rollouts it counts, which keeps a shard report small enough to
cross Ray actors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

_GROWTH = 1.1
_FIRST_MS = 0.1
NUM_BUCKETS = 200


def bucket_of(latency_ms: float) -> int:
    """The bucket index of one latency (clamped to the first and last bucket)."""
    if latency_ms <= _FIRST_MS:
        return 0
    index = int(math.log(latency_ms / _FIRST_MS, _GROWTH)) + 1
    return min(index, NUM_BUCKETS - 1)


def upper_bound_ms(index: int) -> float:
    """The upper edge of bucket ``index``: the value a quantile in that bucket is reported as."""
    return _FIRST_MS * _GROWTH**index


def merge(histograms: Iterable[Sequence[int]]) -> list[int]:
    """Add histograms bucket by bucket (empty histograms count as all zeros)."""
    total = [0] * NUM_BUCKETS
    for histogram in histograms:
        for index, count in enumerate(histogram):
            total[index] += count
    return total


def quantile_ms(histogram: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile (0..1) as the upper edge of its bucket, or None for an empty histogram."""
    count = sum(histogram)
    if count == 0:
        return None
    rank = max(1, math.ceil(q * count))
    seen = 0
    for index, n in enumerate(histogram):
        seen += n
        if seen >= rank:
            return upper_bound_ms(index)
    return upper_bound_ms(NUM_BUCKETS - 1)
