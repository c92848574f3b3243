"""The capture coordinator and the contracts the sources' readers fulfil (see docs/runtime.md, "Capture")."""
