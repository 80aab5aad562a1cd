"""The two checks the head server's auth rests on: which hosts are loopback (no token needed) and which
``Authorization`` values carry the token."""

from __future__ import annotations

import pytest

from gym_ray.servers.redaction import bearer_matches, is_loopback


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("localhost", True),
        (" LocalHost ", True),
        ("127.0.0.1", True),
        ("127.9.8.7", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("example.com", False),
        ("localhost.example.com", False),
        ("", False),
        ("not an address", False),
    ],
)
def test_is_loopback(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


@pytest.mark.parametrize(
    ("authorization", "token", "expected"),
    [
        ("Bearer s3cret", "s3cret", True),
        ("bearer s3cret", "s3cret", True),
        ("BEARER  s3cret ", "s3cret", True),
        ("Basic s3cret", "s3cret", False),
        ("Token s3cret", "s3cret", False),
        ("s3cret", "s3cret", False),
        ("Bearer s3cret2", "s3cret", False),
        ("Bearer ", "s3cret", False),
        ("Bearer s3cret", "", False),
        ("Bearer s3cret", None, False),
        (None, "s3cret", False),
        ("", "s3cret", False),
    ],
)
def test_bearer_matches(authorization: str | None, token: str | None, expected: bool) -> None:
    assert bearer_matches(authorization, token) is expected
