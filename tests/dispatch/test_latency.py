import pytest

from gym_ray.dispatch import latency


@pytest.mark.parametrize(
    ("value_ms", "bucket"),
    [
        pytest.param(0.0, 0, id="zero"),
        pytest.param(0.1, 0, id="first-edge"),
        pytest.param(0.105, 1, id="just-above-first"),
        pytest.param(1.0, 25, id="one-ms"),
        pytest.param(1e12, latency.NUM_BUCKETS - 1, id="clamped"),
    ],
)
def test_bucket_of(value_ms: float, bucket: int) -> None:
    assert latency.bucket_of(value_ms) == bucket


def test_quantiles_are_within_ten_percent_and_histograms_merge_by_adding() -> None:
    first = [0] * latency.NUM_BUCKETS
    second = [0] * latency.NUM_BUCKETS
    for value in range(1, 51):
        first[latency.bucket_of(float(value))] += 1
    for value in range(51, 101):
        second[latency.bucket_of(float(value))] += 1
    merged = latency.merge([first, second, []])
    assert sum(merged) == 100
    p50 = latency.quantile_ms(merged, 0.5)
    p99 = latency.quantile_ms(merged, 0.99)
    # the 50th value is 50 ms and the 99th is 99 ms: each is reported as its bucket's upper edge
    assert p50 == latency.upper_bound_ms(latency.bucket_of(50.0))
    assert p99 == latency.upper_bound_ms(latency.bucket_of(99.0))
    assert p50 is not None
    assert p99 is not None
    assert 50.0 <= p50 <= 55.0
    assert 99.0 <= p99 <= 108.9
    assert latency.quantile_ms([0] * latency.NUM_BUCKETS, 0.5) is None
