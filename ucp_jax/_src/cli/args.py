"""The `ucp` command's arguments that name things: sizes, and `MODULE:NAME` references to a
user's target functions and rules, each refused with what it should be."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..errors import UcpError


class CliError(UcpError, ValueError):
    """A command-line argument names nothing usable (a module, a function, a list of rules, a
    folder): `main` prints it as one line, `ucp <command>: <message>`, with exit status 1."""


def shard_size(text: str) -> int:
    """argparse type of `export hf --max-shard-size`: bytes, from `5GB`, `500MB`, `2GiB`, `123`."""
    from ..frameworks.hf.export import parse_size  # no torch, no JAX

    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write a number of bytes above 0 (e.g. 5000000000) or one "
            "with a unit: 5GB, 500MB (KB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: of 1024)"
        ) from None


def module_ref(ref: str) -> str:
    """argparse type of --target and --rules: `MODULE:NAME`, checked for its form only."""
    module, _, name = ref.partition(":")
    if not module or not name:
        raise argparse.ArgumentTypeError(
            f"{ref!r} is not MODULE:NAME; write the module, a colon and the name in it, e.g. "
            "mytrain.targets:make_targets"
        )
    return ref


def load_ref(ref: str, option: str = "--target") -> Any:
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


def target_trees(ref: str) -> tuple[Any, Any]:
    """(params targets, opt_state targets or None) from the function `--target` names."""
    make = load_ref(ref, "--target")
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
    trees = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    _check_target_leaves(ref, trees)
    return trees


def _check_target_leaves(ref: str, trees: tuple[Any, Any]) -> None:
    """Every leaf of what `--target` returned is a target (a user error otherwise, exit 1)."""
    import jax

    from ..mapping.binding import LEAF_TYPES

    for which, tree in zip(("params", "opt_state"), trees):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if not isinstance(leaf, LEAF_TYPES):
                at = jax.tree_util.keystr(path) or "(the whole tree)"
                raise CliError(
                    f"--target {ref!r} returned {which} targets whose leaf {at} is a "
                    f"{type(leaf).__name__} ({leaf!r:.40}); the function must return trees of "
                    "jax.ShapeDtypeStruct (ucp.targets makes them), arrays or numbers"
                )


def rule_list(ref: str) -> list[Any]:
    """The list of (regex, pattern) rules `--rules` names."""
    rules = load_ref(ref, "--rules")
    if not isinstance(rules, (list, tuple)):
        raise CliError(
            f"--rules {ref!r} is of type {type(rules).__name__}, not a list of rules; pass "
            "MODULE:NAME of a list of (regex, pattern) pairs, e.g. RULES = "
            "[(r'layers\\.\\d+\\.kernel', ucp.Fused(...))]"
        )
    return list(rules)
