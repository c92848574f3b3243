"""Sinks: where batches land. The landing zone is the one sink (DESIGN.md section 5)."""

from __future__ import annotations

from cdcd.config import Config
from cdcd.runtime.interfaces import Sink


def make_sink(config: Config) -> Sink:
    """The sink the config asks for."""
    from cdcd.landing.objstore import Settings
    from cdcd.sinks.landing import LandingSink

    s3 = config.landing.s3
    return LandingSink(
        config.landing.path,
        ack=config.landing.ack,
        retention_s=config.landing.retention_s,
        source_kind=config.source.kind,
        open_retry_s=config.runtime.source_retry_timeout_s, open_retry_max_s=config.runtime.reconnect_max_s,
        s3=Settings(endpoint=s3.endpoint, region=s3.region, path_style=s3.path_style,
                    access_key_id=s3.access_key_id, secret_access_key=s3.secret(), timeout_s=s3.timeout_s),
    )


def zone_name(config: Config) -> str:
    """The landing zone as the operator wrote it: its ``s3://`` URL (``landing.path`` is a ``Path``, which keeps one
    slash of it), or the directory."""
    from cdcd.landing.objstore import zone_name

    return zone_name(config.landing.path)
