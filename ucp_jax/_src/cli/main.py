"""The `ucp` command's entry point: its parser, and one line for any error."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ..errors import UcpError
from .args import module_ref
from .checkpoints import (
    delete_command,
    inspect_checkpoint,
    list_command,
    plan_command,
    verify_checkpoint,
)
from .foreign import add_commands, jax_command, torch_command
from .text import printable


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
        type=module_ref,
        help="MODULE:FUNCTION returning params targets or (params, opt_state) targets",
    )
    p.add_argument(
        "--rules", type=module_ref, help="MODULE:NAME of a list of (regex, pattern) rules"
    )
    add_commands(sub)
    args = ap.parse_args(argv)
    try:
        if args.cmd in ("convert", "export") and args.kind in ("orbax", "maxtext"):
            return jax_command(args)
        if args.cmd in ("convert", "export"):
            return torch_command(args)
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
        print(printable(f"ucp {args.cmd}: {e}"), file=sys.stderr)
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
        print(printable(msg), file=sys.stderr)
        return 2
