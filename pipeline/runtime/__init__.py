"""The multiprocess runtime: shared-memory tensors, message schemas, ZeroMQ
transport, heartbeats, the deterministic step plan, launch and monitoring."""
