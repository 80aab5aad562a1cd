"""A real S3 API on 127.0.0.1 for the object-store tests: moto in server mode (an HTTP endpoint that
implements conditional writes), one process for the session, a fresh bucket per test."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gym_ray.bench.store_bench import start_moto

#: The test credentials; the tests look for this secret in every object and output a run leaves.
SECRET = "s3cr3t-that-must-never-be-written"


def store_env(endpoint: str) -> dict[str, str]:
    """The AWS SDK environment that points at ``endpoint`` with the test credentials."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing-key-id",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
    }


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    proc = start_moto(port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@dataclass
class Bucket:
    """A fresh bucket on the test endpoint, and a client to look into it."""

    name: str
    client: Any
    stage_root: Path

    def url(self, prefix: str) -> str:
        return f"s3://{self.name}/{prefix}"

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", ()))

    def read(self, key: str) -> bytes:
        return bytes(self.client.get_object(Bucket=self.name, Key=key)["Body"].read())


@pytest.fixture
def bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Bucket:
    """A new bucket; the AWS SDK environment (and so every gym-ray subprocess's) points at it, and this
    test's processes keep their local copies under ``tmp_path/stage``."""
    import boto3

    for name, value in store_env(s3_endpoint).items():
        monkeypatch.setenv(name, value)
    stage_root = tmp_path / "stage"
    monkeypatch.setenv("GYM_RAY_STAGE_DIR", str(stage_root))
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    client = boto3.client("s3")
    name = f"runs-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=name)
    assert os.environ["AWS_ENDPOINT_URL"] == s3_endpoint
    return Bucket(name, client, stage_root)
