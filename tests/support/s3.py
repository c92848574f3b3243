"""Talking to the tests' S3 server (devtools.s3server.S3Server) directly: a client, listing; a daemon's config that
lands there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from devtools.s3server import S3Server
from devtools.servers import PostgresServer, free_port


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


def pg_daemon_config(tmp_path: Path, pg: PostgresServer, db: str, landing: str, s3: S3Server, tables: list[str],
                     max_batch_events: int) -> Path:
    """`cdcd run`'s config for PostgreSQL ``tables`` landing on ``landing`` (``s3://``) on the server; the secret
    key in a file beside it (``secret_access_key_file``), as an operator keeps it."""
    cfg = tmp_path / "cdcd.toml"
    secret = tmp_path / "s3-secret"
    secret.write_text(s3.secret_key + "\n")
    cfg.write_text(f"""[source]
kind = "postgres"
port = {pg.port}
user = "postgres"
database = "{db}"
tables = {json.dumps(tables)}
[source.postgres]
slot = "s_{db}"
publication = "p_{db}"
[state]
path = "{tmp_path / 'state'}"
[landing]
path = "{landing}"
max_batch_events = {max_batch_events}
max_batch_delay_ms = 50
[landing.s3]
endpoint = "{s3.endpoint}"
region = "{s3.region}"
access_key_id = "{s3.access_key}"
secret_access_key_file = "{secret}"
[http]
listen = "127.0.0.1:{free_port()}"
[log]
format = "json"
""")
    return cfg
