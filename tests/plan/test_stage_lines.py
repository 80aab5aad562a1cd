"""Shard files are written a batch of rows at a time: the bytes are ``json``'s compact lines, whatever the
batch holds."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from gym_ray._json import dumps_compact_lines
from tests.test_json_equivalence import AWKWARD, UNSERIALIZABLE, _random_value


def _json_lines(values: list[Any]) -> bytes:
    return b"".join(
        json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n" for v in values
    )


def test_a_batch_is_json_s_compact_lines_for_random_values() -> None:
    rng = random.Random(20261202)
    for _ in range(400):
        batch = [{"v": _random_value(rng)} for _ in range(rng.randrange(1, 12))]
        assert dumps_compact_lines(batch) == _json_lines(batch), batch


@pytest.mark.parametrize("index", range(len(AWKWARD)))
def test_one_awkward_value_among_plain_rows_is_written_as_json_writes_it(index: int) -> None:
    batch = [{"a": 1, "s": "x"}, AWKWARD[index], {"b": [1.5, "é"]}]
    try:
        expected = _json_lines(batch)
    except (TypeError, ValueError) as exc:
        with pytest.raises(type(exc)):
            dumps_compact_lines(batch)
        return
    assert dumps_compact_lines(batch) == expected


def test_an_empty_batch_is_no_bytes_and_an_unserializable_row_raises_as_json() -> None:
    assert dumps_compact_lines([]) == b""
    for value in UNSERIALIZABLE:
        with pytest.raises(TypeError):
            dumps_compact_lines([{"ok": 1}, value])
