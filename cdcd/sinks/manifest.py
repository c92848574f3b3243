"""Batch manifests: what a landed batch holds, written last to make it visible."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from cdcd.errors import SinkFatal
from cdcd.sinks.layout import FORMAT_NAME, FORMAT_VERSION


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
    if doc.get("version") != FORMAT_VERSION:
        raise SinkFatal(
            f"landing manifest {path} has format version {doc.get('version')!r}; this cdcd reads version "
            f"{FORMAT_VERSION}: upgrade cdcd or drain the landing zone with the matching version"
        )
    if seal(doc)["checksum"] != doc.get("checksum"):
        raise SinkFatal(f"landing manifest {path}: checksum mismatch; the file was changed after landing")
    return doc
