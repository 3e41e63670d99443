"""The on-disk format: what a universal checkpoint is as bytes.

`version` and `dtypes` name things; `manifest` is the versioned JSON (atoms, slots, patterns,
source); `store` is where the arrays live (kvstore URLs, zarr3 specs with crc32c, chunking) and the
commit protocol (stage, write `manifest.json`, then `COMMIT`). Nothing here knows about JAX.
"""
