"""Process lifecycle around the runtime: signals, sd_notify, HTTP endpoints, progress, control."""
