"""CompactIndex and DenseCounters behave like the dicts they replace in preprocessing."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gym_ray.errors import InternalError
from gym_ray.plan._compact_index import CompactIndex, DenseCounters

U64_MAX = 2**64 - 1

# Keys that stress linear probing: small sequential ints, full-range ints, multiples of large powers of two
# (identical low bits), and the edges of the range.
u64_keys = st.one_of(
    st.integers(min_value=0, max_value=64),
    st.integers(min_value=0, max_value=U64_MAX),
    st.builds(lambda k, shift: (k << shift) & U64_MAX, st.integers(0, 15), st.integers(32, 63)),
    st.sampled_from([0, 1, U64_MAX, U64_MAX - 1, 2**63]),
)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), u64_keys), max_size=300),
    capacity=st.sampled_from([2, 4, 64]),
)
def test_compact_index_behaves_like_setdefault_dict(ops: list[tuple[bool, int]], capacity: int) -> None:
    index = CompactIndex(capacity=capacity)
    model: dict[int, int] = {}
    for is_add, key in ops:
        if is_add:
            assert index.add(key) == model.setdefault(key, len(model))
        else:
            assert index.get(key) == model.get(key)
            assert (key in index) == (key in model)
        assert len(index) == len(model)
    assert list(index) == list(model)
    assert all(index.get(key) == position for key, position in model.items())
    assert index.capacity >= 2 * len(index)


def test_compact_index_numbers_keys_in_first_seen_order() -> None:
    index = CompactIndex(capacity=2)
    assert [index.add(key) for key in (7, U64_MAX, 0, 7, 2**40, 0, U64_MAX)] == [0, 1, 2, 0, 3, 2, 1]
    assert list(index) == [7, U64_MAX, 0, 2**40]
    assert (len(index), index.capacity) == (4, 8)


def test_compact_index_many_keys_grow_by_doubling() -> None:
    index = CompactIndex()
    keys = [(i * 0x9E3779B97F4A7C15) & U64_MAX for i in range(20_000)]
    assert [index.add(key) for key in keys] == list(range(20_000))
    assert [index.add(key) for key in reversed(keys)] == list(reversed(range(20_000)))
    assert (len(index), index.capacity) == (20_000, 65_536)
    assert index.get(keys[12_345]) == 12_345


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(-1, id="negative"),
        pytest.param(2**64, id="too-big"),
        pytest.param(True, id="bool"),
        pytest.param(1.0, id="float"),
        pytest.param("1", id="str"),
    ],
)
def test_compact_index_add_rejects_non_uint64_keys(key: Any) -> None:
    index = CompactIndex()
    with pytest.raises(InternalError, match=r"CompactIndex keys are ints in \[0, 2\*\*64\), got "):
        index.add(key)
    assert len(index) == 0
    assert index.get(key) is None
    assert key not in index


def test_compact_index_get_treats_bools_like_a_dict() -> None:
    index = CompactIndex()
    index.add(5)
    index.add(1)
    assert (index.get(True), index.get(False), True in index) == (1, None, True)


@pytest.mark.parametrize(
    "capacity",
    [
        pytest.param(0, id="zero"),
        pytest.param(1, id="one"),
        pytest.param(12, id="not-power-of-two"),
        pytest.param(True, id="bool"),
        pytest.param(16.0, id="float"),
    ],
)
def test_compact_index_rejects_bad_capacity(capacity: Any) -> None:
    with pytest.raises(InternalError, match="CompactIndex capacity must be a power of two >= 2, got "):
        CompactIndex(capacity=capacity)


# Keys for counters: dense non-negative ints, and the kinds that must go to the dict fallback.
counter_keys = st.one_of(
    st.integers(min_value=0, max_value=40),
    st.integers(min_value=-5, max_value=-1),
    st.integers(min_value=2**20, max_value=2**80),
    st.builds(lambda k: 2**k - 1, st.integers(1, 30)),
)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), counter_keys), max_size=400),
    min_dense=st.sampled_from([1, 4, 1024]),
)
def test_dense_counters_behave_like_a_dict_of_counts(ops: list[tuple[bool, int]], min_dense: int) -> None:
    counters = DenseCounters(min_dense=min_dense)
    model: dict[int, int] = {}
    for is_take, key in ops:
        if is_take:
            expected = model.get(key, 0)
            model[key] = expected + 1
            assert counters.take(key) == expected
        else:
            assert counters.get(key) == model.get(key, 0)
        assert len(counters) == len(model)
    assert all(counters.get(key) == count for key, count in model.items())
    assert counters.dense_size <= max(min_dense, 4 * len(model))


def test_dense_counters_dense_keys_stay_in_the_array() -> None:
    counters = DenseCounters(min_dense=4)
    assert [counters.take(task) for task in range(100)] == [0] * 100
    assert [counters.take(task) for task in (3, 3, 99, 0)] == [1, 2, 1, 1]
    assert (len(counters), counters.dense_size) == (100, 128)


def test_dense_counters_sparse_keys_do_not_grow_the_array() -> None:
    counters = DenseCounters(min_dense=4)
    sparse = [2**k - 1 for k in range(2, 41)]
    assert [counters.take(task) for task in sparse] == [0] * len(sparse)
    assert (len(counters), counters.dense_size) == (len(sparse), 4)
    assert [counters.get(task) for task in (3, 7, 2**40 - 1, 2**40)] == [1, 1, 1, 0]


def test_dense_counters_widen_past_one_byte_and_two_bytes() -> None:
    counters = DenseCounters(min_dense=2)
    assert [counters.take(0) for _ in range(70_000)][-3:] == [69_997, 69_998, 69_999]
    assert (counters.get(0), counters.get(1)) == (70_000, 0)


def test_dense_counters_move_large_dict_counts_into_the_array() -> None:
    counters = DenseCounters(min_dense=4)
    counters.take(0)
    for _ in range(300):
        counters.take(5)  # past [0, 4) while a quarter of it is used: the dict keeps it
    assert counters.dense_size == 4
    counters.take(1)
    assert counters.take(6) == 0  # half used: the range doubles to 8 and takes key 5 with its count of 300
    assert (counters.dense_size, counters.take(5), counters.get(5), len(counters)) == (8, 300, 301, 4)


@pytest.mark.parametrize(
    "min_dense",
    [pytest.param(0, id="zero"), pytest.param(True, id="bool"), pytest.param(2.0, id="float")],
)
def test_dense_counters_reject_bad_min_dense(min_dense: Any) -> None:
    with pytest.raises(InternalError, match="DenseCounters min_dense must be an int >= 1, got "):
        DenseCounters(min_dense=min_dense)
