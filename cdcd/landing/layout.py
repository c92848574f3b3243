"""The landing zone's directory layout and durable file primitives.

```
LANDING/
  manifests/<seq:020d>.json      a batch is visible once its manifest is here
  data/<seq:020d>-<n:04d>.parquet one file per table (per schema version) per batch
                                 (object storage: <seq:020d>-<n:04d>-<attempt>.parquet, unique per attempt)
  consumed/<seq:020d>            written by the consumer once the batch is in the target
  zone.json                      the zone's identity, created once with the zone
```

Temporary files start with ``.`` and end with ``.tmp``: Spark, pyarrow and
the reader skip them, and ``open()`` deletes them after a crash.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

FORMAT_NAME = "cdcd-landing"
FORMAT_VERSION = 4
#: The version of a manifest that holds a ranged covered record (``cdcd snapshot --where``): a reader of version 4
#: would apply it to the whole table, so it must refuse it; every other manifest stays version 4, readable by
#: consumers built before ranges.
RANGED_VERSION = 5
#: Manifest versions this cdcd reads: 1 has no ``zone_id``, 2 no ``covered`` list, 3 no column ``id``/``fill``,
#: 4 no ``range`` in covered records, otherwise the same.
READABLE_VERSIONS = (1, 2, 3, 4, 5)

MANIFESTS = "manifests"
DATA = "data"
CONSUMED = "consumed"
ZONE_FILE = "zone.json"

_MANIFEST_RE = re.compile(r"^(\d{20})\.json$")
_DATA_RE = re.compile(r"^(\d{20})-(\d{4})(?:-[0-9a-f]{1,32})?\.parquet$")
_CONSUMED_RE = re.compile(r"^(\d{20})$")


def manifest_name(seq: int) -> str:
    return f"{seq:020d}.json"


def data_name(seq: int, index: int, attempt: str | None = None) -> str:
    """A data file's name; on object storage (no rename) the writer's ``attempt`` id makes it unique."""
    return f"{seq:020d}-{index:04d}-{attempt}.parquet" if attempt else f"{seq:020d}-{index:04d}.parquet"


def consumed_name(seq: int) -> str:
    return f"{seq:020d}"


def manifest_seq(name: str) -> int | None:
    m = _MANIFEST_RE.match(name)
    return int(m.group(1)) if m else None


def data_seq(name: str) -> int | None:
    m = _DATA_RE.match(name)
    return int(m.group(1)) if m else None


def consumed_seq(name: str) -> int | None:
    m = _CONSUMED_RE.match(name)
    return int(m.group(1)) if m else None


def is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def seqs_in(directory: Path) -> list[int]:
    """Sorted batch seqs of the manifests in ``directory``."""
    if not directory.is_dir():
        return []
    found = (manifest_seq(e.name) for e in os.scandir(directory))
    return sorted(s for s in found if s is not None)
