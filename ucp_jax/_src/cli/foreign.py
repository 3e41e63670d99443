"""`ucp convert` and `ucp export`: checkpoints of other trainers in and out (PyTorch, Orbax,
MaxText), the framework modules imported on demand (torch and JAX only where needed)."""

from __future__ import annotations

import sys
from typing import Any

from ..checkpoint import Checkpoint
from ..frameworks.common.destination import not_local
from ..util import config
from ..util.libc import limit_malloc_arenas
from .args import CliError, shard_size
from .text import mib

_FLOATS = "as float32, bfloat16 or float16 (fp32, bf16, fp16; default: as stored)"


def add_commands(sub: Any) -> None:
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
    p.add_argument("--dtype", default=None,
                   help="store weights as float32, bfloat16, float16 or float64 (fp32, bf16, "
                   "fp16; default: as stored)")  # fmt: skip
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
    p.add_argument("--max-shard-size", default="5GB", type=shard_size,
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
    p.add_argument("--lr", type=float, default=None,
                   help="the loading job's lr (Megatron pairs parameter groups by it; default: "
                   "the source's, else 1e-4)")  # fmt: skip
    p.add_argument("--min-lr", type=float, default=None, help="the loading job's min_lr")
    p.add_argument("--weight-decay", type=float, default=None,
                   help="weight decay (default: the source's, else 0)")  # fmt: skip
    p.add_argument("--betas", type=float, nargs=2, default=None, metavar=("B1", "B2"),
                   help="Adam's betas, which Megatron loads from the checkpoint (default: the "
                   "source's, else 0.9 0.999)")  # fmt: skip
    p.add_argument("--eps", type=float, default=None,
                   help="Adam's epsilon (default: the source's, else 1e-8)")  # fmt: skip
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


def jax_command(args: Any) -> int:
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


def torch_command(args: Any) -> int:
    try:
        return _run_torch_command(args)
    except (FileExistsError, FileNotFoundError, NotADirectoryError) as e:
        print(f"ucp {args.cmd}: {e}", file=sys.stderr)
        return 1


def _run_torch_command(args: Any) -> int:
    import importlib
    import os
    import time

    if args.cmd == "convert":
        src = str(args.src)
        if not_local(src):
            raise CliError(
                f"{src}: the {args.kind} source is read from a local folder; copy it from the "
                "store first (the universal checkpoint, DST, may be a URL)"
            )
        if args.kind == "hf" and os.path.isfile(src):
            raise CliError(
                f"{src}: a file; pass the model folder holding config.json and the weights "
                f"({os.path.dirname(os.path.abspath(src))})"
            )

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
            optimizer=args.optimizer, expert_parallel=args.expert_parallel, lr=args.lr,
            min_lr=args.min_lr, weight_decay=args.weight_decay, eps=args.eps,
            betas=tuple(args.betas) if args.betas else None, overwrite=args.overwrite,
        )  # fmt: skip
        from ..frameworks.megatron.tracker import ITER_RE

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
        f"wrote {ck.path}: {len(ck.atoms)} atoms, {mib(total)} MiB, "
        f"{'no step' if ck.step is None else f'step {ck.step}'}, "
        f"in {time.perf_counter() - t0:.2f} s{' (model only: no optimizer state)' if only else ''}"
    )
    return 0
