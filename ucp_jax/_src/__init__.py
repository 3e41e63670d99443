"""The implementation behind `ucp_jax`, `ucp_jax.torch`, `ucp_jax.memory` and `ucp_jax.orbax`.

Folders and modules, from the bottom up (each imports only what lies below it; the layers are
import-linter contracts in pyproject.toml, checked by `lint-imports`; see docs/ARCHITECTURE.md):

- `errors`, `util/`: exception types; small utilities (config, dtypes, libc, GC pauses, barriers);
- `untrusted/`: reading bytes a checkpoint's author controls: the one JSON reader, limits, safe
  paths, the restricted unpickler, lazy torch tensors, safetensors headers;
- `mapping/`: leaves <-> atoms (names, patterns, rules, optimizer slots, bindings);
- `format/`: the on-disk format (manifest, store and commit protocol, integrity, version);
- the operations: `checkpoint` (open / read), `resolve`, `plan_report`, `save`, `restore`,
  `targets`;
- `memory/`: the in-memory snapshot tier (layout, redundancy schemes, recovery);
- `llama_config`, `hf_config`: the Llama family's configuration, shared by `ucp_jax.models` and
  the importers; a Hugging Face `config.json` read into it;
- `frameworks/`: one folder per foreign format, each with its read and write side (`deepspeed/`,
  `megatron/`, `hf/`, `dcp/`, `orbax/`), over `frameworks/common/` (the atom writer, progress,
  DCP files);
- `cli`: the `ucp` command.
"""
