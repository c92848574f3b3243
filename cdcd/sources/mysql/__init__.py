"""The MySQL / MariaDB source: binlog streaming (pymysqlreplication) and snapshots (aiomysql)."""

from cdcd.sources.mysql.source import MySqlSource

__all__ = ["MySqlSource"]
