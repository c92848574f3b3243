"""The landing zone format (docs/landing-format.md): the one contract between the daemon and consumers.

- ``layout``: directory and file names, ``columns``: the data files' columns (the ``_cdc_*`` names, the
  Arrow schema), ``manifest``: manifests as typed values (built by the sink, returned by the reader) and
  their JSON, ``zone``: the zone's identity, ``reader``: what consumers (the Spark job, tests) read.

The daemon's sink (``cdcd.sinks.landing``) writes through these modules; the Spark
job reads through them and imports nothing of ``cdcd.sinks``.
"""
