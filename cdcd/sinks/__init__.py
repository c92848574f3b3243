"""Sinks: where batches land. The landing zone is the one sink (DESIGN.md section 5)."""

from __future__ import annotations

from cdcd.config import Config
from cdcd.runtime.interfaces import Sink


def make_sink(config: Config) -> Sink:
    """The sink the config asks for."""
    from cdcd.sinks.landing import LandingSink

    return LandingSink(
        config.landing.path,
        ack=config.landing.ack,
        retention_s=config.landing.retention_s,
        source_kind=config.source.kind,
    )
