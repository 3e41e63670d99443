"""`ucp inspect`, `verify`, `ls`, `index`, `rm` and `plan`: universal checkpoints looked at,
checked, listed, deleted, and restores planned."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..checkpoint import Checkpoint
from ..errors import UcpError
from ..format import index, store
from ..format.manifest import COMMIT
from ..mapping.pattern_json import chain_text
from ..util.dtypes import np_dtype
from .args import rule_list, target_trees
from .text import mib, path_forms, printable


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
        print(printable(line), file=out)

    emit(f"checkpoint  {ck.path}")
    emit(f"format      {m.format}   step {m.step}")
    src = m.source
    shape = ", ".join(
        f"{src[k]} {what}" for k, what in (("process_count", "process(es)"),
                                           ("device_count", "device(s)")) if k in src
    )  # fmt: skip
    fw = f"  imported from {src['framework']}" if "framework" in src else ""
    emit(f"source      {src.get('library', '?')} {src.get('version', '')}{fw}  {shape}".rstrip())
    emit(f"atoms       {len(m.atoms)}   {mib(total)} MiB")
    if m.extra is not None:
        emit(f"extra       {json.dumps(m.extra)[:200]}")
    rows: list[tuple[str, ...]] = [("atom", "shape", "slots", "pattern", "MiB")]
    for name in sorted(m.atoms):
        a = m.atoms[name]
        slots = ",".join(f"{k}:{v.dtype}" for k, v in a.slots.items())
        cells = (name, str(tuple(a.shape)), slots, chain_text(a.pattern), mib(a.nbytes))
        rows.append(tuple(printable(c) for c in cells))  # escaped before the widths are taken
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
        named = str(e).startswith(path_forms(path))
        print(printable(f"FAIL {e}" if named else f"FAIL {path}: {e}"), file=out)
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
            print(printable(f"FAIL {p}"), file=out)
        print(printable(f"{len(problems)} problem(s) in {narrays} arrays of {ck.path}"), file=out)
        return 1
    ok = f"OK {ck.path}: {narrays} arrays, {mib(nbytes)} MiB read, all checksums match"
    print(printable(ok), file=out)
    return 0


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
        print(printable(str(p)), file=out)
    return 0


def _blocks(shape: Sequence[int], chunks: Sequence[int]) -> Any:
    """Chunk-aligned boxes covering an array, one shard file at a time (bounded memory)."""
    for _, box in store.chunk_grid(shape, chunks):
        yield box


def plan_command(path: str, target: str, rules: str | None = None, out: Any = None) -> int:
    """Print the restore plan of `path` for the targets `MODULE:FUNCTION()` returns.

    The function returns params targets or (params targets, opt_state targets); `rules` names a
    list of rules (`MODULE:NAME`). Exit status 0 when a restore would go through, 1 otherwise.
    A reference that names no module, function or list raises CliError (`ucp plan`: exit 1).

    >>> plan_command("/tmp/ckpt/step_10", "mytrain:targets")  # doctest: +SKIP
    """
    from ..plan_report import plan

    given = rule_list(rules) if rules else ()  # checked before the target function runs
    params_t, opt_t = target_trees(target)
    report = plan(path, params_t, opt_t, rules=given)
    shown = dataclasses.replace(  # atom names and messages come from the checkpoint: escaped
        report,
        path=printable(str(report.path)),
        unexpected=[printable(n) for n in report.unexpected],
        problems=[dataclasses.replace(p, message=printable(p.message)) for p in report.problems],
    )
    text = "\n".join(printable(line) for line in str(shown).split("\n"))
    print(text, file=out or sys.stdout)
    return 0 if report.ok else 1


def delete_command(paths: Sequence[str]) -> int:
    """`ucp rm`: delete each checkpoint (`ucp.delete_checkpoint`), in order; stop at the first
    that fails (what was deleted before it is said)."""
    from ..format.removal import delete_checkpoint

    for path in paths:
        delete_checkpoint(path)
        print(f"deleted {path}")
    return 0
