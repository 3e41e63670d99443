"""The in-memory tier: asynchronous snapshots in per-node shared memory, redundancy, recovery."""
