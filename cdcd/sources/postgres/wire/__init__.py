"""The PostgreSQL wire: pure code of the frontend/backend protocol and of pgoutput, and the replication connection
that moves the bytes. Nothing here knows the captured tables, their shapes or cdcd's events."""
