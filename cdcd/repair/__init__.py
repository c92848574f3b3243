"""`cdcd repair`: find what differs between the source and the mirror, and re-sync exactly those keys.

``plan`` turns verify's differences into key-list re-syncs; ``command`` asks the running daemon for them, waits,
and checks the mirror again.
"""

from __future__ import annotations

from cdcd.repair.command import repair

__all__ = ["repair"]
