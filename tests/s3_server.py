"""A local S3 server (moto) for tests, on 127.0.0.1 only: no test touches the network.

Use the context manager anywhere::

    from s3_server import moto_s3          # tests/ is on sys.path (see below)
    with moto_s3() as s3:
        s3.uri("run")                      # "s3://diloco-test/run"

or the module-scoped pytest fixture ``s3_bucket`` from a test module; importing it under
its own name makes pyflakes see the function argument as a redefinition, so bind it::

    import s3_server
    s3_bucket = s3_server.s3_bucket        # now a fixture of this module

    def test_x(s3_bucket): ...

``tests/`` has no ``__init__.py``, so pytest's default "prepend" import mode puts
``tests/`` itself on ``sys.path`` when it loads ``tests/conftest.py``; ``import s3_server``
therefore works from any test folder (``from tests.s3_server import ...`` only works
under ``python -m pytest``, which also puts the current folder on the path).

While the server runs, the process environment points every AWS client at it
(``AWS_ENDPOINT_URL``, fake credentials, region us-east-1). Processes started in that
window inherit it: request ``s3_bucket`` *before* ``ray_local`` in a test's arguments so
Ray's workers see the endpoint too.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

import pytest

_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_PROFILE",
    "AWS_EC2_METADATA_DISABLED",
)


class S3Server:
    """A running moto S3 server with one bucket.

    Attributes:
        endpoint: ``http://127.0.0.1:<port>``.
        bucket: the bucket created at start.
        client: a boto3 S3 client for that endpoint (for checks behind pyarrow's back).
    """

    def __init__(self, endpoint: str, bucket: str, client):
        self.endpoint, self.bucket, self.client = endpoint, bucket, client

    def uri(self, *parts: str) -> str:
        """``s3://<bucket>/<parts joined by '/'>``."""
        return "/".join([f"s3://{self.bucket}", *parts])

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under ``prefix`` in the bucket, sorted."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@contextlib.contextmanager
def moto_s3(bucket: str = "diloco-test") -> Iterator[S3Server]:
    """Start moto's S3 server on a free port of 127.0.0.1, create ``bucket``, and point
    the AWS environment variables at it until the block ends (then restore them).

    Args:
        bucket: name of the bucket to create.

    Yields:
        The :class:`S3Server`.
    """
    import boto3
    from moto.server import ThreadedMotoServer

    # Werkzeug logs one line per request to stderr; tests only care about failures.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    saved = {k: os.environ.get(k) for k in _ENV}
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        for k in _ENV:
            os.environ.pop(k, None)
        # pyarrow's AWS SDK reads AWS_ENDPOINT_URL itself (AWS_ENDPOINT_URL_S3 would win,
        # hence popped above); no IMDS lookups for credentials or region.
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_REGION="us-east-1",
            AWS_EC2_METADATA_DISABLED="true",
        )
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        client.create_bucket(Bucket=bucket)
        yield S3Server(endpoint, bucket, client)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture(scope="module")
def s3_bucket() -> Iterator[S3Server]:
    """One moto S3 server and bucket ``diloco-test`` per test module (see module docstring)."""
    with moto_s3() as server:
        yield server
