from devtools.servers import MariaDBServer, PostgresServer


def test_postgres_is_logical(pg_server: PostgresServer, pg_db: str) -> None:
    assert pg_server.psql("SHOW wal_level", pg_db) == "logical"
    assert pg_server.port != 5432


def test_mariadb_binlog_is_row_full(maria_server: MariaDBServer, maria_db: str) -> None:
    row = maria_server.sql("SELECT @@log_bin, @@binlog_format, @@binlog_row_image, @@binlog_row_metadata")
    assert row.split("\t") == ["1", "ROW", "FULL", "FULL"]
    assert maria_server.port != 3306
    assert maria_server.sql("SHOW TABLES", maria_db) == ""
