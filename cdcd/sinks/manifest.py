"""Batch manifests: what a landed batch holds, written last to make it visible."""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cdcd.errors import SinkFatal
from cdcd.sinks.layout import FORMAT_NAME, FORMAT_VERSION, READABLE_VERSIONS, ZONE_FILE


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


def new_zone() -> dict[str, Any]:
    """A landing zone's identity document: created once, when the zone is created."""
    return {"format": FORMAT_NAME, "zone_id": uuid.uuid4().hex, "created_at": datetime.now(UTC).isoformat()}


def read_zone_id(root: Path) -> str | None:
    """The landing zone's identity; None for a zone an older cdcd created and no daemon has opened since."""
    path = root / ZONE_FILE
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SinkFatal(f"landing zone identity {path} cannot be read: {exc}; restore it (its zone_id is in "
                        "every manifest landed since it was created)") from exc
    zone = doc.get("zone_id") if isinstance(doc, dict) else None
    if not isinstance(zone, str) or not zone:
        raise SinkFatal(f"landing zone identity {path} has no zone_id; restore it from a manifest's zone_id")
    return zone
