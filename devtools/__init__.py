"""Dev-only helpers, not installed with cdcd: the soak (``devtools.soak``)."""
