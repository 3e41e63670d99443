"""The `ucp` command: inspect and verify universal checkpoints; convert from / export to PyTorch."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from .checkpoint import Checkpoint
from .errors import UcpError
from .format import index, store
from .format.manifest import COMMIT
from .mapping.patterns import chain_text
from .util import config
from .util.dtypes import np_dtype
from .util.libc import limit_malloc_arenas


class CliError(UcpError, ValueError):
    """A command-line argument names nothing usable (a module, a function, a list of rules, a
    folder): `main` prints it as one line, `ucp <command>: <message>`, with exit status 1."""


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _printable(text: str) -> str:
    r"""`text` with every character that is not printable (control characters such as ESC, BEL,
    NUL and newline, bidi overrides, line separators) escaped as repr() shows it (`\x1b`, `\n`,
    `\u202e`); printable unicode stays as it is.

    Names read from a checkpoint (atoms, slots, patterns, sources, keys of an object store) are
    untrusted: printed raw, a crafted one could retitle, clear or rewrite the terminal.

    >>> _printable("w\x1b]0;title\x07"), _printable("größe.kernel")
    ('w\\x1b]0;title\\x07', 'größe.kernel')
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def inspect_checkpoint(path: str, as_json: bool = False, out: Any = None) -> int:
    """Print a checkpoint's step, source and atoms (shapes, dtypes, slots, patterns, sizes).

    >>> inspect_checkpoint("/tmp/ckpt/step_10")  # doctest: +SKIP
    """
    out = out or sys.stdout
    ck = Checkpoint(path)
    m = ck.manifest
    if as_json:
        d = m.to_json()
        d["path"] = ck.path
        d["total_bytes"] = sum(a.nbytes for a in m.atoms.values())
        for name, a in m.atoms.items():
            d["atoms"][name]["nbytes"] = a.nbytes
        json.dump(d, out, indent=1)
        out.write("\n")
        return 0
    total = sum(a.nbytes for a in m.atoms.values())

    def emit(line: str) -> None:  # names and sources come from the checkpoint: escaped
        print(_printable(line), file=out)

    emit(f"checkpoint  {ck.path}")
    emit(f"format      {m.format}   step {m.step}")
    src = m.source
    shape = ", ".join(
        f"{src[k]} {what}" for k, what in (("process_count", "process(es)"),
                                           ("device_count", "device(s)")) if k in src
    )  # fmt: skip
    fw = f"  imported from {src['framework']}" if "framework" in src else ""
    emit(f"source      {src.get('library', '?')} {src.get('version', '')}{fw}  {shape}".rstrip())
    emit(f"atoms       {len(m.atoms)}   {_mib(total)} MiB")
    if m.extra is not None:
        emit(f"extra       {json.dumps(m.extra)[:200]}")
    rows: list[tuple[str, ...]] = [("atom", "shape", "slots", "pattern", "MiB")]
    for name in sorted(m.atoms):
        a = m.atoms[name]
        slots = ",".join(f"{k}:{v.dtype}" for k, v in a.slots.items())
        cells = (name, str(tuple(a.shape)), slots, chain_text(a.pattern), _mib(a.nbytes))
        rows.append(tuple(_printable(c) for c in cells))  # escaped before the widths are taken
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        emit("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def verify_checkpoint(path: str, out: Any = None) -> int:
    """Read every chunk of every array, checking checksums, completeness and the manifest.

    Returns:
        0 when everything checks, 1 otherwise (each problem is printed, naming the atom and slot).
    """
    out = out or sys.stdout
    try:
        ck = Checkpoint(path)
    except UcpError as e:  # its message mostly starts with the path, as given or made absolute
        named = str(e).startswith(_path_forms(path))
        print(_printable(f"FAIL {e}" if named else f"FAIL {path}: {e}"), file=out)
        return 1
    problems: list[str] = []
    nbytes = 0
    with contextlib.suppress(UcpError, ValueError):  # all arrays' metadata in one batch of reads;
        ck.open_arrays([(n, s) for n, a in ck.atoms.items() for s in a.slots])  # (a bad one: below)
    for name in sorted(ck.atoms):
        a = ck.atoms[name]
        for slot, info in a.slots.items():
            where = f"atom {name!r} slot {slot!r}"
            try:
                arr = ck.array(name, slot)
                want = a.slot_shape(slot)
                if tuple(arr.shape) != want:
                    problems.append(f"{where}: stored shape {tuple(arr.shape)}, manifest {want}")
                    continue
                if arr.dtype.numpy_dtype != np_dtype(info.dtype):
                    problems.append(f"{where}: stored dtype {arr.dtype}, manifest {info.dtype}")
                    continue
                if ck.loc.local_path is None:  # one batch of fingerprint reads, not one a block
                    ck.check_fingerprints([(name, slot, [(0, d) for d in want])])
                for box in _blocks(want, info.chunks):
                    data = ck.read(name, slot, box)
                    nbytes += data.nbytes
            except (UcpError, ValueError) as e:
                problems.append(f"{where}: {e}")
    narrays = sum(len(a.slots) for a in ck.atoms.values())
    if problems:
        for p in problems:
            print(_printable(f"FAIL {p}"), file=out)
        print(_printable(f"{len(problems)} problem(s) in {narrays} arrays of {ck.path}"), file=out)
        return 1
    ok = f"OK {ck.path}: {narrays} arrays, {_mib(nbytes)} MiB read, all checksums match"
    print(_printable(ok), file=out)
    return 0


def _path_forms(path: Any) -> tuple[str, ...]:
    """The ways a message may name `path`: as given, and as a location (a local one absolute)."""
    forms = [str(path)]
    with contextlib.suppress(Exception):  # an unparsable path: as given only
        forms.append(store.Location.parse(path).url)
    return tuple(forms)


def list_command(path: str, *, build: bool = False, out: Any = None) -> int:
    """`ucp ls`: print the committed checkpoints under `path`, one a line; `ucp index` first
    indexes an object-store folder from a listing of every key (once; see format/index.py)."""
    out = out or sys.stdout
    cmd = "index" if build else "ls"
    loc = store.Location.parse(path)
    if loc.local_path is not None and not os.path.isdir(loc.local_path):
        what = "a file, not a folder" if os.path.exists(loc.local_path) else "no such folder"
        print(f"ucp {cmd}: {loc.local_path}: {what}", file=sys.stderr)
        return 1
    if build and loc.local_path is not None:
        print(f"ucp index: {loc.local_path} is a local folder, which has no index to build (ucp "
              "index is for object-store folders: s3://, gs://, memory://); list it with ucp ls "
              f"{loc.local_path}", file=sys.stderr)  # fmt: skip
        return 1
    found = None if build else index.list_checkpoints(path)
    if not found and loc.exists(COMMIT):  # (`index` checks first: it writes into the folder)
        parent = os.path.dirname(loc.local_path) if loc.local_path else index.parent(loc)[0].url
        print(f"ucp {cmd}: {loc.url} is a checkpoint itself, not a folder of checkpoints; pass "
              f"the folder that holds it (ucp {cmd} {parent}), or see this one with ucp inspect "
              f"{loc.url}", file=sys.stderr)  # fmt: skip
        return 1
    if build:
        names = index.build(loc)
        print(f"indexed {len(names)} checkpoint(s) in {path}", file=out)
        found = index.list_checkpoints(path)
    for p in found or ():
        print(_printable(str(p)), file=out)
    return 0


def _blocks(shape: Sequence[int], chunks: Sequence[int]) -> Any:
    """Chunk-aligned boxes covering an array, one shard file at a time (bounded memory)."""
    for _, box in store.chunk_grid(shape, chunks):
        yield box


def _shard_size(text: str) -> int:
    """argparse type of `export hf --max-shard-size`: bytes, from `5GB`, `500MB`, `2GiB`, `123`."""
    from .frameworks.hf.export import parse_size  # no torch, no JAX

    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write a number of bytes above 0 (e.g. 5000000000) or one "
            "with a unit: 5GB, 500MB (KB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: of 1024)"
        ) from None


_FLOATS = "as float32, bfloat16 or float16 (fp32, bf16, fp16; default: as stored)"


def _add_torch_commands(sub: Any) -> None:
    """`ucp convert deepspeed|safetensors|hf|dcp|megatron|torchtitan|orbax|maxtext SRC DST`;
    `ucp export deepspeed-universal|hf|megatron|torchtitan|dcp|maxtext|orbax SRC DST`."""
    conv = sub.add_parser(
        "convert",
        help="import a checkpoint of another trainer (PyTorch, Orbax, MaxText) as a universal one",
    )
    kinds = conv.add_subparsers(dest="kind", required=True)
    p = kinds.add_parser(
        "deepspeed", help="DeepSpeed ZeRO-1/2/3 folder (or ds_to_universal output)"
    )
    p.add_argument("--tag", default=None, help="tag to import (default: the `latest` file)")
    p.add_argument("--hf-config", default=None,
                   help="the Hugging Face model's config.json: name atoms as `convert hf` does "
                   "(default: a config.json beside the checkpoint, if any)")  # fmt: skip
    p.add_argument("--no-hf-config", action="store_true",
                   help="name atoms as the torch parameters even with a config.json beside")  # fmt: skip
    p = kinds.add_parser("safetensors", help="a .safetensors file, an index.json or their folder")
    p.add_argument(
        "--preset", default=None, help="map names/layouts onto a model (e.g. llama-demo)"
    )
    p.add_argument("--dtype", default=None, help=f"store weights {_FLOATS} (or float64)")
    p = kinds.add_parser(
        "hf", help="a Hugging Face Llama/Mistral/Qwen2/Mixtral folder (config.json)"
    )
    p.add_argument("--dtype", default=None, help=f"store weights {_FLOATS}")
    p = kinds.add_parser("dcp", help="a torch.distributed.checkpoint folder (e.g. FSDP2)")
    p.add_argument("--model-prefix", default="model.", help="prefix stripped from model entries")
    p = kinds.add_parser(
        "megatron", help="a Megatron-Core torch_dist checkpoint of a GPTModel (dense or MoE)"
    )
    p.add_argument("--heads", type=int, default=None,
                   help="attention heads (asked for only where the checkpoint records none)")  # fmt: skip
    p.add_argument("--top-k", type=int, default=None,
                   help="experts per token of a MoE model (where not recorded)")  # fmt: skip
    p.add_argument(
        "--vocab-size", type=int, default=None, help="true vocabulary (drops TP padding)"
    )
    p.add_argument(
        "--norm-eps", type=float, default=None, help="norm epsilon (default: args, 1e-5)"
    )
    p.add_argument("--rope-theta", type=float, default=None, help="RoPE base (default: args, 1e4)")
    p.add_argument("--activation", default=None, choices=("silu", "gelu", "gelu_pytorch_tanh"),
                   help="the MLP's activation (default: SiLU if gated, else GELU)")  # fmt: skip
    p = kinds.add_parser("torchtitan", help="a torchtitan step folder of a Llama 3 model")
    p.add_argument("--heads", type=int, default=None, help="attention heads (not recorded)")
    p.add_argument("--norm-eps", type=float, default=1e-5, help="RMSNorm epsilon")
    p.add_argument("--rope-theta", type=float, default=500000.0, help="RoPE base")
    p.add_argument("--no-rope-scaling", action="store_true", help="no Llama 3 RoPE scaling")
    p = kinds.add_parser(
        "orbax", help="an Orbax checkpoint: item folder, CheckpointManager step folder or root"
    )
    p.add_argument("--item", default=None, help="only this item of a step folder (e.g. state)")
    p.add_argument("--step", type=int, default=None, help="step of a CheckpointManager root")
    p = kinds.add_parser("maxtext", help="a MaxText checkpoint (Orbax): <run>/checkpoints, a step")
    p.add_argument("--step", type=int, default=None, help="step folder (default: the latest)")
    _maxtext_options(p)
    exp = sub.add_parser(
        "export", help="write a universal checkpoint in another framework's format"
    )
    ekinds = exp.add_subparsers(dest="kind", required=True)
    p = ekinds.add_parser("deepspeed-universal", help="a folder DeepSpeed resumes (load_universal)")
    p.add_argument("--expert-parallel", type=int, default=None,
                   help="ep_size of the MoE job that loads it (default: the source run's, else 1)")  # fmt: skip
    p = ekinds.add_parser("hf", help="a Hugging Face model folder (from_pretrained loads it)")
    p.add_argument("--max-shard-size", default="5GB", type=_shard_size,
                   help="bytes per shard: a number of bytes or a size like 5GB, 500MB, 2GiB "
                   "(default 5GB)")  # fmt: skip
    p.add_argument("--dtype", default=None, help=f"write weights {_FLOATS}")
    p = ekinds.add_parser(
        "megatron", help="a Megatron-Core torch_dist folder (any TP/PP/EP loads it)"
    )
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="model dtype")
    p.add_argument("--optimizer", default="plain", choices=("plain", "distributed"),
                   help="the loading job's optimizer: plain, or the distributed optimizer "
                   "(fully_reshardable)")  # fmt: skip
    p.add_argument("--expert-parallel", type=int, default=None,
                   help="EP size of the MoE job that loads it (1: one optimizer; >1: chained)")  # fmt: skip
    p.add_argument("--padded-vocab", type=int, default=None, help="vocabulary rows Megatron holds")
    p = ekinds.add_parser("torchtitan", help="a torchtitan step folder it resumes from")
    p.add_argument("--world-size", type=int, default=None,
                   help="data-parallel ranks of the resuming job (default: the source's)")  # fmt: skip
    p.add_argument("--lr", type=float, default=8e-4, help="optimizer lr if the source has none")
    p = ekinds.add_parser("dcp", help="a plain torch.distributed.checkpoint folder")
    p.add_argument("--names", default="atoms", choices=("atoms", "hf", "torchtitan"),
                   help="tensor names: the atoms', Hugging Face's or torchtitan's")  # fmt: skip
    p.add_argument("--no-optimizer", action="store_true", help="the model's tensors only")
    p = ekinds.add_parser("maxtext", help="a MaxText checkpoint folder (MaxText resumes from it)")
    p.add_argument("--unscanned", action="store_true", help="layers_<i> (scan_layers=False)")
    p.add_argument("--step-dir", type=int, default=None, help="step folder (default: step - 1)")
    p.add_argument("--params-only", action="store_true", help="weights only (load_parameters_path)")
    _maxtext_options(p, export=True)
    p = ekinds.add_parser("orbax", help="a plain Orbax checkpoint of the state as a pytree")
    p.add_argument(
        "--manager", action="store_true", help="CheckpointManager layout DST/<step>/ITEM"
    )
    p.add_argument("--item", default="default", help="the item name with --manager (default)")
    p.add_argument("--step", type=int, default=None, help="step folder with --manager")
    for parser in (*kinds.choices.values(), *ekinds.choices.values()):
        parser.add_argument("src")
        parser.add_argument("dst")
        parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _maxtext_options(p: Any, export: bool = False) -> None:
    """The MaxText model conventions the checkpoint does not record."""
    if not export:
        p.add_argument("--norm-eps", type=float, default=1e-5,
                       help="normalization_layer_epsilon (default 1e-5)")  # fmt: skip
        p.add_argument("--rope-theta", type=float, default=10000.0,
                       help="rope_max_timescale (default 10000)")  # fmt: skip
    p.add_argument("--rope", choices=("default", "llama3.1"), default=None if export else "default",
                   help="MaxText's rope_type (llama3.1: interleaved pairs)")  # fmt: skip
    p.add_argument("--unscaled-query", action="store_true",
                   help="the query kernel holds no 1/sqrt(head_dim) (query_pre_attn_scalar, qk-norm)")  # fmt: skip


def _jax_command(args: Any) -> int:
    """`ucp convert maxtext|orbax`, `ucp export maxtext|orbax` (need JAX and Orbax)."""
    import importlib

    name = {("convert", "orbax"): "orbax.read", ("convert", "maxtext"): "maxtext.read",
            ("export", "orbax"): "orbax.export", ("export", "maxtext"): "maxtext.export"}[
        (args.cmd, args.kind)]  # fmt: skip
    mod = importlib.import_module(f"ucp_jax._src.frameworks.{name}")
    try:
        return int(mod.convert_main(args) if args.cmd == "convert" else mod.export_main(args))
    except (FileExistsError, FileNotFoundError, NotADirectoryError) as e:
        print(f"ucp {args.cmd}: {e}", file=sys.stderr)
        return 1


def _torch_command(args: Any) -> int:
    try:
        return _run_torch_command(args)
    except (FileExistsError, FileNotFoundError, NotADirectoryError) as e:
        print(f"ucp {args.cmd}: {e}", file=sys.stderr)
        return 1


def _run_torch_command(args: Any) -> int:
    import importlib
    import os
    import time

    # the modules of ucp_jax._src.frameworks that serve the command, imported on demand
    modules = {"deepspeed": ("deepspeed.zero", "deepspeed.universal"), "safetensors": ("hf.safetensors",),
               "dcp": ("dcp.read",), "hf": ("hf.read",), "megatron": ("megatron.read",)}.get(args.kind, ("deepspeed.export",))  # fmt: skip
    if args.kind == "torchtitan":
        modules = ("torchtitan.read", "torchtitan.export")
    if args.cmd == "export" and args.kind in ("hf", "megatron", "dcp"):
        modules = (f"{args.kind}.export",)
    try:  # DeepSpeed and safetensors imports need no torch; DCP and the export do
        mods = [importlib.import_module(f"ucp_jax._src.frameworks.{m}") for m in modules]
        mod = mods[0]
    except ImportError as e:
        print(
            f"ucp {args.cmd}: needs PyTorch ({e}); install it with pip install 'ucp_jax[torch]'",
            file=sys.stderr,
        )
        return 1
    if config.cli_caps_malloc_arenas():  # bounded memory: see limit_malloc_arenas
        limit_malloc_arenas(2)
    t0 = time.perf_counter()
    progress = False if args.no_progress else None
    if args.cmd == "export" and args.kind == "hf":
        out = mod.export_hf(
            args.src, args.dst, dtype=args.dtype, max_shard_size=args.max_shard_size,
            overwrite=args.overwrite, progress=progress,
        )  # fmt: skip
        print(f"wrote {out} in {time.perf_counter() - t0:.2f} s (from_pretrained loads it)")
        return 0
    if args.cmd == "export" and args.kind == "megatron":
        out = mod.export_megatron(
            args.src, args.dst, dtype=args.dtype, padded_vocab=args.padded_vocab,
            optimizer=args.optimizer, expert_parallel=args.expert_parallel,
            overwrite=args.overwrite,
        )  # fmt: skip
        from .frameworks.megatron.tracker import ITER_RE

        how = ("Megatron-LM's --load of its parent folder loads it" if ITER_RE.fullmatch(
            os.path.basename(os.path.normpath(out))) else "dist_checkpointing.load loads it; "
            "Megatron-LM's --load wants <save>/iter_XXXXXXX")  # fmt: skip
        print(f"wrote {out} in {time.perf_counter() - t0:.2f} s ({how})")
        return 0
    if args.cmd == "export" and args.kind == "torchtitan":
        out = mods[1].export_torchtitan(args.src, args.dst, world_size=args.world_size, lr=args.lr,
                                        overwrite=args.overwrite, progress=progress)  # fmt: skip
        note = "" if mods[1].dataloader_kept(args.src, args.world_size) else (
            "; no data loader state for this world size: resume with "
            "--checkpoint.exclude-from-loading dataloader")  # fmt: skip
        print(f"wrote {out} in {time.perf_counter() - t0:.2f} s (torchtitan resumes from it{note})")
        return 0
    if args.cmd == "export" and args.kind == "dcp":
        out = mod.export_dcp(args.src, args.dst, names=args.names, optimizer=not args.no_optimizer,
                             overwrite=args.overwrite, progress=progress)  # fmt: skip
        print(
            f"wrote {out} in {time.perf_counter() - t0:.2f} s (torch.distributed.checkpoint.load)"
        )
        return 0
    if args.cmd == "export":
        out = mod.export_deepspeed_universal(
            args.src, args.dst, expert_parallel=args.expert_parallel, overwrite=args.overwrite,
            progress=progress,
        )  # fmt: skip
        print(f"wrote {out} in {time.perf_counter() - t0:.2f} s (load it with load_universal)")
        return 0
    if args.kind == "deepspeed":
        src = os.fspath(args.src)
        universal = os.path.isdir(os.path.join(src, "zero")) or os.path.isfile(
            os.path.join(src, "latest_universal")
        )
        if universal:
            out = mods[1].import_deepspeed_universal(
                src, args.dst, tag=args.tag, overwrite=args.overwrite, progress=progress
            )
        else:
            hf = False if args.no_hf_config else args.hf_config
            out = mod.import_deepspeed(src, args.dst, tag=args.tag, overwrite=args.overwrite,
                                       progress=progress, hf_config=hf)  # fmt: skip
    elif args.kind == "hf":
        out = mod.import_hf(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite)
    elif args.kind == "safetensors":
        out = mod.import_safetensors(
            args.src, args.dst, preset=args.preset, dtype=args.dtype, overwrite=args.overwrite
        )
    elif args.kind == "torchtitan":
        out = mod.import_torchtitan(
            args.src, args.dst, heads=args.heads, norm_eps=args.norm_eps,
            rope_theta=args.rope_theta, rope_scaling=not args.no_rope_scaling,
            overwrite=args.overwrite,
        )  # fmt: skip
    elif args.kind == "megatron":
        out = mod.import_megatron(
            args.src, args.dst, heads=args.heads, vocab_size=args.vocab_size,
            norm_eps=args.norm_eps, rope_theta=args.rope_theta, top_k=args.top_k,
            activation=args.activation, overwrite=args.overwrite,
        )  # fmt: skip
    else:
        out = mod.import_dcp(
            args.src, args.dst, model_prefix=args.model_prefix, overwrite=args.overwrite,
            progress=progress,
        )  # fmt: skip
    ck = Checkpoint(args.dst)  # DST, not `out`: a kvstore spec keeps its endpoint
    total = sum(a.nbytes for a in ck.atoms.values())
    only = (ck.manifest.source.get("torchtitan") or {}).get("model_only")
    print(
        f"wrote {ck.path}: {len(ck.atoms)} atoms, {_mib(total)} MiB, step {ck.step}, "
        f"in {time.perf_counter() - t0:.2f} s{' (model only: no optimizer state)' if only else ''}"
    )
    return 0


def _module_ref(ref: str) -> str:
    """argparse type of --target and --rules: `MODULE:NAME`, checked for its form only."""
    module, _, name = ref.partition(":")
    if not module or not name:
        raise argparse.ArgumentTypeError(
            f"{ref!r} is not MODULE:NAME; write the module, a colon and the name in it, e.g. "
            "mytrain.targets:make_targets"
        )
    return ref


def _load(ref: str, option: str = "--target") -> Any:
    """`package.module:name` -> that object (the module imported from the working directory too);
    `option` names the argument in the messages (CliError) of a reference that names nothing."""
    import importlib
    from inspect import ismodule

    module, _, name = ref.partition(":")
    if not module or not name:
        raise CliError(
            f"{option} {ref!r} is not MODULE:NAME; write the module, a colon and the name in it, "
            "e.g. mytrain.targets:make_targets"
        )
    sys.path.insert(0, os.getcwd())
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        raise CliError(
            f"{option} {ref!r}: cannot import module {module!r} ({e}); run ucp from the folder "
            "that holds it, or put it on PYTHONPATH"
        ) from e
    finally:
        sys.path.remove(os.getcwd())
    if not hasattr(found, name):
        where = getattr(found, "__file__", None) or module
        names = sorted(
            n for n, v in vars(found).items() if not n.startswith("_") and not ismodule(v)
        )
        has = (
            f"; it has {', '.join(names[:12])}{', ...' if len(names) > 12 else ''}" if names else ""
        )
        raise CliError(
            f"{option} {ref!r}: module {module!r} ({where}) has no {name!r}{has}; fix the name "
            "after the colon"
        )
    return getattr(found, name)


def _targets(ref: str) -> tuple[Any, Any]:
    """(params targets, opt_state targets or None) from the function `--target` names."""
    make = _load(ref, "--target")
    if not callable(make):
        raise CliError(
            f"--target {ref!r} is of type {type(make).__name__}, not a function; pass "
            "MODULE:FUNCTION of a function that returns params targets or (params, opt_state) "
            "targets"
        )
    made = make()
    if made is None:
        raise CliError(
            f"--target {ref!r} returned None; the function must return the params targets or a "
            "(params targets, opt_state targets) pair (is its return statement missing?)"
        )
    return made if isinstance(made, tuple) and len(made) == 2 else (made, None)


def _rules(ref: str) -> list[Any]:
    """The list of (regex, pattern) rules `--rules` names."""
    rules = _load(ref, "--rules")
    if not isinstance(rules, (list, tuple)):
        raise CliError(
            f"--rules {ref!r} is of type {type(rules).__name__}, not a list of rules; pass "
            "MODULE:NAME of a list of (regex, pattern) pairs, e.g. RULES = "
            "[(r'layers\\.\\d+\\.kernel', ucp.Fused(...))]"
        )
    return list(rules)


def plan_command(path: str, target: str, rules: str | None = None, out: Any = None) -> int:
    """Print the restore plan of `path` for the targets `MODULE:FUNCTION()` returns.

    The function returns params targets or (params targets, opt_state targets); `rules` names a
    list of rules (`MODULE:NAME`). Exit status 0 when a restore would go through, 1 otherwise.
    A reference that names no module, function or list raises CliError (`ucp plan`: exit 1).

    >>> plan_command("/tmp/ckpt/step_10", "mytrain:targets")  # doctest: +SKIP
    """
    from .plan_report import plan

    given = _rules(rules) if rules else ()  # checked before the target function runs
    params_t, opt_t = _targets(target)
    report = plan(path, params_t, opt_t, rules=given)
    shown = dataclasses.replace(  # atom names and messages come from the checkpoint: escaped
        report,
        path=_printable(str(report.path)),
        unexpected=[_printable(n) for n in report.unexpected],
        problems=[dataclasses.replace(p, message=_printable(p.message)) for p in report.problems],
    )
    text = "\n".join(_printable(line) for line in str(shown).split("\n"))
    print(text, file=out or sys.stdout)
    return 0 if report.ok else 1


def delete_command(paths: Sequence[str]) -> int:
    """`ucp rm`: delete each checkpoint (`ucp.delete_checkpoint`), in order; stop at the first
    that fails (what was deleted before it is said)."""
    from .format.removal import delete_checkpoint

    for path in paths:
        delete_checkpoint(path)
        print(f"deleted {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `ucp` command."""
    ap = argparse.ArgumentParser(prog="ucp", description="Universal checkpoints for JAX.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="show atoms, shapes, dtypes, slots, patterns, sizes, step")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON, with sizes")
    p = sub.add_parser("verify", help="read every chunk; check checksums and the manifest")
    p.add_argument("path")
    p = sub.add_parser(
        "ls", help="the committed checkpoints in a folder (object stores: its index)"
    )
    p.add_argument("path")
    p = sub.add_parser(
        "rm", help="delete checkpoints, each whole or not at all (even if killed midway)"
    )
    p.add_argument("paths", nargs="+", metavar="path")
    p = sub.add_parser(
        "index",
        help="index the checkpoints of an object-store folder (for ones older versions saved)",
    )
    p.add_argument("path")
    p = sub.add_parser("plan", help="what a restore onto given targets would do (reads no array)")
    p.add_argument("path")
    p.add_argument(
        "--target",
        required=True,
        type=_module_ref,
        help="MODULE:FUNCTION returning params targets or (params, opt_state) targets",
    )
    p.add_argument(
        "--rules", type=_module_ref, help="MODULE:NAME of a list of (regex, pattern) rules"
    )
    _add_torch_commands(sub)
    args = ap.parse_args(argv)
    try:
        if args.cmd in ("convert", "export") and args.kind in ("orbax", "maxtext"):
            return _jax_command(args)
        if args.cmd in ("convert", "export"):
            return _torch_command(args)
        if args.cmd == "inspect":
            return inspect_checkpoint(args.path, args.json)
        if args.cmd == "plan":
            return plan_command(args.path, args.target, args.rules)
        if args.cmd == "rm":
            return delete_command(args.paths)
        if args.cmd in ("ls", "index"):
            return list_command(args.path, build=args.cmd == "index")
        return verify_checkpoint(args.path)
    except UcpError as e:  # a message may quote names from a checkpoint: escaped
        print(_printable(f"ucp {args.cmd}: {e}"), file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `ucp inspect --json | head`
        return 0
    except KeyboardInterrupt:
        print(f"ucp {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, as every error of the CLI (UCP_DEBUG=1: the traceback)
        if os.environ.get("UCP_DEBUG"):
            raise
        msg = f"ucp {args.cmd}: {type(e).__name__}: {e} (UCP_DEBUG=1 shows where)"
        print(_printable(msg), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
