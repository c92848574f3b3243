"""The landing zone format (docs/landing-format.md): the one contract between the daemon and consumers.

- ``layout``: directory and file names, ``manifest``: building and checking manifests,
  ``zone``: the zone's identity, ``reader``: what consumers (the Spark job, tests) read.

The daemon's sink (``cdcd.sinks.landing``) writes through these modules; the Spark
job reads through them and imports nothing of ``cdcd.sinks``.
"""
