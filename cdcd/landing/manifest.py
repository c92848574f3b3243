"""Batch manifests: what a landed batch holds, written last to make it visible.

The writer builds them with ``file_entry`` and ``batch_manifest`` (then ``seal``);
readers check them with ``load_manifest``. The fields are docs/landing-format.md's.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cdcd.errors import SinkFatal
from cdcd.landing.layout import DATA, FORMAT_NAME, FORMAT_VERSION, READABLE_VERSIONS


def canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def seal(doc: dict[str, Any]) -> dict[str, Any]:
    """Add the checksum over every other field."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return {**body, "checksum": "sha256:" + hashlib.sha256(canonical(body)).hexdigest()}


def load_manifest(path: Path) -> dict[str, Any]:
    """Read and check a manifest; a damaged one is fatal (the landing zone was tampered with)."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise SinkFatal(f"landing manifest {path} cannot be read: {exc}; restore it or remove the batch") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise SinkFatal(f"landing manifest {path} is not a {FORMAT_NAME} manifest")
    if doc.get("version") not in READABLE_VERSIONS:
        raise SinkFatal(
            f"landing manifest {path} has format version {doc.get('version')!r}; this cdcd reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))} (writes {FORMAT_VERSION}): upgrade cdcd or drain the "
            "landing zone with the matching version"
        )
    if seal(doc)["checksum"] != doc.get("checksum"):
        raise SinkFatal(f"landing manifest {path}: checksum mismatch; the file was changed after landing")
    return doc


def file_entry(name: str, table: dict[str, Any], rows: int, blob: bytes, positions: set[str]) -> dict[str, Any]:
    """A manifest's entry for the data file ``data/<name>`` holding ``blob``."""
    return {
        "path": f"{DATA}/{name}",
        "table": table,
        "rows": rows,
        "bytes": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "first_position": min(positions),
        "last_position": max(positions),
    }


def covered_entry(schema: str, name: str, below: str) -> dict[str, Any]:
    """A manifest's record of a completed whole-table re-snapshot: the table's rows below ``below`` are gone."""
    return {"table": {"schema": schema, "name": name}, "below": below}


def covered_records(manifest: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The (schema, table, below) records of a manifest; none before version 3."""
    return [(c["table"]["schema"], c["table"]["name"], c["below"]) for c in manifest.get("covered", ())]


def batch_manifest(seq: int, run_id: str, zone_id: str, source_kind: str, rows: int, positions: set[str],
                   files: list[dict[str, Any]], covered: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The sealed manifest that publishes batch ``seq``'s data files (and its re-snapshot records)."""
    return seal(
        {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "batch_seq": seq,
            "run_id": run_id,
            "zone_id": zone_id,
            "source_kind": source_kind,
            "created_at": datetime.now(UTC).isoformat(),
            "event_count": rows,
            "first_position": min(positions) if positions else None,
            "last_position": max(positions) if positions else None,
            "files": files,
            "covered": covered or [],
        }
    )
