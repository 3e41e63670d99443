"""The implementation behind `ucp_jax`, `ucp_jax.torch`, `ucp_jax.memory` and `ucp_jax.orbax`.

Folders follow the data path (see docs/ARCHITECTURE.md):

- `format/`: the on-disk format (manifest, store and commit protocol, dtypes, version);
- `mapping/`: leaves <-> atoms (names, patterns, rules, optimizer slots, bindings);
- the operations, one module each: `save`, `restore`, `checkpoint` (open / read), `targets`,
  `orbax`, `cli`;
- `torch/`: PyTorch formats in and out, one module per format over a shared reader/writer core;
- `memory/`: the in-memory snapshot tier (layout, redundancy schemes, recovery);
- `util/`: small shared utilities (config, libc, GC pauses, barriers).
"""
