"""The runtime: state machine, commit barrier, batching and handoff driver."""
