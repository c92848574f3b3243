"""The landing zone's identity (``zone.json``): created once, with the zone."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cdcd.errors import SinkFatal
from cdcd.fsutil import write_durably
from cdcd.landing.layout import FORMAT_NAME, ZONE_FILE
from cdcd.landing.manifest import canonical
from cdcd.landing.objstore import ObjectStore


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


def ensure_zone_id(root: Path) -> str:
    """The zone's id; a zone without one (new, or made by an older cdcd) gets it now, once.

    Consumers bind their target to it: a zone removed and created again (a
    re-snapshot) starts its batch seqs at 1 again and must not be taken for
    the zone the target was built from.
    """
    zone = read_zone_id(root)
    if zone is None:
        doc = new_zone()
        write_durably(root / ZONE_FILE, canonical(doc))
        zone = str(doc["zone_id"])
    return zone


def ensure_object_zone_id(store: ObjectStore) -> str:
    """``ensure_zone_id`` on object storage: the identity is created with a conditional PUT, so of two writers
    creating a zone at once one identity wins and both read it back."""
    where = f"{store.location.url}/{ZONE_FILE}"
    blob = store.get(ZONE_FILE)
    if blob is None:
        store.create(ZONE_FILE, canonical(new_zone()))
        blob = store.get(ZONE_FILE)
    try:
        doc = json.loads(blob or b"")
    except ValueError as exc:
        raise SinkFatal(f"landing zone identity {where} cannot be read: {exc}; restore it (its zone_id is in "
                        "every manifest landed since it was created)") from exc
    zone = doc.get("zone_id") if isinstance(doc, dict) else None
    if not isinstance(zone, str) or not zone:
        raise SinkFatal(f"landing zone identity {where} has no zone_id; restore it from a manifest's zone_id")
    return zone
