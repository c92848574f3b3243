import botocore.exceptions
import pytest
from support import s3

from devtools.s3server import S3Server
from devtools.servers import MariaDBServer, PostgresServer


def test_postgres_is_logical(pg_server: PostgresServer, pg_db: str) -> None:
    assert pg_server.psql("SHOW wal_level", pg_db) == "logical"
    assert pg_server.port != 5432


def test_mariadb_binlog_is_row_full(maria_server: MariaDBServer, maria_db: str) -> None:
    row = maria_server.sql("SELECT @@log_bin, @@binlog_format, @@binlog_row_image, @@binlog_row_metadata")
    assert row.split("\t") == ["1", "ROW", "FULL", "FULL"]
    assert maria_server.port != 3306
    assert maria_server.sql("SHOW TABLES", maria_db) == ""


def test_s3_server_honours_conditional_create(s3_server: S3Server, s3_bucket: str) -> None:
    """The landing zone's manifests on object storage rely on If-None-Match: * refusing a second create."""
    c = s3.client(s3_server)
    assert s3.keys(s3_server, s3_bucket) == []
    c.put_object(Bucket=s3_bucket, Key="zone/m.json", Body=b"first", IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        c.put_object(Bucket=s3_bucket, Key="zone/m.json", Body=b"second", IfNoneMatch="*")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert c.get_object(Bucket=s3_bucket, Key="zone/m.json")["Body"].read() == b"first"
    assert s3_server.endpoint.startswith("http://127.0.0.1:")
    with pytest.raises(botocore.exceptions.ClientError):
        s3.client(s3_server, access_key="someone", secret_key="wrong").list_objects_v2(Bucket=s3_bucket)
