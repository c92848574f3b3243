"""cdcd: a change-data-capture daemon for PostgreSQL and MySQL/MariaDB into Spark."""

__version__ = "0.1.0"
