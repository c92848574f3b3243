"""Talking to the tests' S3 server (devtools.servers.S3Server) directly: a client, listing, the landing settings."""

from __future__ import annotations

from typing import Any

import boto3
from botocore.config import Config

from devtools.servers import S3Server


def client(server: S3Server, *, access_key: str | None = None, secret_key: str | None = None) -> Any:
    """A boto3 S3 client for the server, path-style, with the root keys unless others are given."""
    return boto3.client(
        "s3", endpoint_url=server.endpoint, region_name=server.region,
        aws_access_key_id=access_key or server.access_key, aws_secret_access_key=secret_key or server.secret_key,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                      connect_timeout=5, read_timeout=10))


def keys(server: S3Server, bucket: str, prefix: str = "") -> list[str]:
    """Every object key in the bucket under the prefix, sorted."""
    pages = client(server).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))
