"""The runtime's lifecycle states (DESIGN.md section 2)."""

from __future__ import annotations

import enum


class RuntimeState(enum.StrEnum):
    IDLE = "idle"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
