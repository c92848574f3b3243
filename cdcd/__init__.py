"""cdcd: a change-data-capture daemon for PostgreSQL and MySQL/MariaDB into Spark."""

import os as _os

__version__ = "0.1.0"

# Arrow's C++ code (Parquet writing and reading, the ADBC driver's conversions) allocates from the pool that
# ARROW_DEFAULT_MEMORY_POOL names when pyarrow is first imported, before any configuration is read; its own
# default, mimalloc, keeps freed pages per thread. The system allocator keeps cdcd's peak RSS lower at the
# same throughput (cdcd/memory.py, docs/operations.md "Memory"). A value the environment sets is kept.
_os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
