"""PostgreSQL source: streaming replication (pgoutput), exact snapshot handoff, crash-safe resume."""

from cdcd.sources.postgres.source import PostgresSource

__all__ = ["PostgresSource"]
