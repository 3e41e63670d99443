"""Checks of a manifest read from disk (untrusted input) before anything is built from it.

A manifest names files (atom folders, slot paths), sizes (shapes, chunk grids) and dtypes; each is
checked against the rules the writers follow and against limits, before any path is opened or any
buffer allocated, so that a damaged or hostile manifest is a `NotACheckpointError` /
`UnsafePathError` / `LimitError` naming the atom and the field, never a crash, a read outside the
checkpoint or a silent wrong value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..errors import LimitError, NotACheckpointError, UcpError
from ..untrusted.limits import MAX_CHUNK_FILES, MAX_ELEMENTS, MAX_NDIM
from ..untrusted.paths import atom_dir, check_component


def _ints(x: Any, what: str, *, positive: bool) -> tuple[int, ...]:
    if not isinstance(x, list | tuple) or len(x) > MAX_NDIM:
        raise NotACheckpointError(
            f"{what}: expected a list of at most {MAX_NDIM} ints, found {x!r}"
        )
    low = 1 if positive else 0
    for v in x:
        if type(v) is not int or v < low:
            raise NotACheckpointError(
                f"{what}: expected ints >= {low}, found {v!r} in {list(x)!r}; the manifest is "
                "damaged"
            )
    return tuple(x)


def check_shape(shape: Any, what: str) -> tuple[int, ...]:
    """A shape: non-negative ints, at most MAX_NDIM, at most MAX_ELEMENTS elements."""
    s = _ints(shape, what, positive=False)
    n = math.prod(s)
    if n > MAX_ELEMENTS:
        raise LimitError(f"{what}: {list(s)} holds {n} elements, more than {MAX_ELEMENTS}")
    return s


def check_slot(atom: str, slot: Any, d: Any, atom_shape: tuple[int, ...], where: str) -> None:
    """One slot entry: name, path, dtype, chunking and grid size."""
    from ..util.dtypes import np_dtype

    what = f"{where}: atom {atom!r} slot {slot!r}"
    check_component(slot, f"{where}: atom {atom!r}: slot name")
    if not isinstance(d, Mapping):
        raise NotACheckpointError(f"{what}: expected an object, found {type(d).__name__}")
    want = f"{atom_dir(atom)}/{slot}"
    if d.get("path") != want:
        raise NotACheckpointError(
            f"{what}: path {d.get('path')!r}, expected {want!r} (slot paths follow from the "
            "names); the manifest was edited or damaged"
        )
    dt = d.get("dtype")
    try:
        if not isinstance(dt, str):
            raise TypeError
        dtype = np_dtype(dt)
        if dtype.kind not in "biufcV" or dtype.itemsize == 0 or dtype.name != dt:
            raise TypeError  # writers record a canonical name ('float32', never '>f4')
    except (TypeError, ValueError) as e:
        raise NotACheckpointError(f"{what}: unknown dtype {dt!r}; the manifest is damaged") from e
    shape = check_shape(d["shape"], f"{what}: shape") if d.get("shape") is not None else atom_shape
    chunks = _ints(d.get("chunks"), f"{what}: chunks", positive=True)
    if shape and len(chunks) != len(shape):
        raise NotACheckpointError(f"{what}: chunks {list(chunks)} for shape {list(shape)}")
    inner = d.get("inner_chunks")
    if inner is not None:
        inner = _ints(inner, f"{what}: inner_chunks", positive=True)
        if len(inner) != len(chunks) or any(c % i for c, i in zip(chunks, inner)):
            raise NotACheckpointError(
                f"{what}: inner_chunks {list(inner)} do not divide chunks {list(chunks)}"
            )
    files = math.prod(-(-s // c) for s, c in zip(shape, chunks)) if shape else 1
    if files > MAX_CHUNK_FILES:
        raise LimitError(f"{what}: {files} chunk files, more than {MAX_CHUNK_FILES}")
    if math.prod(shape) * dtype.itemsize > 0 and min(chunks, default=1) > 0:
        per_chunk = math.prod(chunks) * dtype.itemsize
        if per_chunk > (1 << 40):
            raise LimitError(f"{what}: one chunk of {per_chunk} bytes, more than 1 TiB")


def check_manifest(d: Mapping[str, Any], where: str) -> None:
    """Validate a parsed manifest (types, names, paths, sizes) before it is used (then
    `check_consistent`, after the COMMIT check: whether it contradicts itself).

    Raises:
        NotACheckpointError, UnsafePathError, LimitError: naming the atom and field.
    """
    atoms = d.get("atoms")
    if not isinstance(atoms, Mapping):
        raise NotACheckpointError(f"{where}: manifest 'atoms' is not an object; damaged")
    step = d.get("step")
    if step is not None and type(step) is not int:
        raise NotACheckpointError(f"{where}: manifest 'step' is {step!r}, expected an int or null")
    for name, a in atoms.items():
        if name in ("", ".", ".."):
            raise NotACheckpointError(f"{where}: atom name {name!r} is not usable; damaged")
        if not isinstance(a, Mapping):
            raise NotACheckpointError(f"{where}: atom {name!r} is not an object; damaged")
        from urllib.parse import quote

        check_component(quote(name, safe=".-_"), f"{where}: atom folder of {name!r}")
        shape = check_shape(a.get("shape"), f"{where}: atom {name!r} shape")
        slots = a.get("slots")
        if not isinstance(slots, Mapping) or not slots:
            raise NotACheckpointError(f"{where}: atom {name!r} has no slots; damaged")
        for slot, s in slots.items():
            check_slot(name, slot, s, shape, where)
        pattern = a.get("pattern", [])
        if not isinstance(pattern, list) or not all(isinstance(p, Mapping) for p in pattern):
            raise NotACheckpointError(f"{where}: atom {name!r} pattern is not a list of objects")
        if not isinstance(a.get("leaf", ""), str) or not isinstance(a.get("fused", []), list):
            raise NotACheckpointError(f"{where}: atom {name!r} leaf/fused fields are damaged")
    for field in ("leaves", "source"):
        if not isinstance(d.get(field, {}), Mapping):
            raise NotACheckpointError(f"{where}: manifest {field!r} is not an object; damaged")
    if not isinstance(d.get("rules", []), list):
        raise NotACheckpointError(f"{where}: manifest 'rules' is not a list; damaged")
    check_patterns(d, where)


def check_patterns(d: Mapping[str, Any], where: str) -> None:
    """Every pattern and rule in the manifest parses (through `pattern_json.pattern_from_json`)."""
    from ..mapping.pattern_json import pattern_from_json

    def parse(p: Any, what: str) -> None:
        try:
            if not isinstance(p, Mapping):
                raise TypeError(f"a {type(p).__name__}, not an object")
            pattern_from_json(p)
        except UcpError as e:
            raise NotACheckpointError(f"{where}: {what}: {e}") from e
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise NotACheckpointError(
                f"{where}: {what} is not a valid pattern ({type(e).__name__}: {e}); the "
                "manifest is damaged"
            ) from e

    for name, a in d["atoms"].items():
        for p in a.get("pattern", []):
            parse(p, f"atom {name!r} pattern {p!r}")
    for i, rule in enumerate(d.get("rules", [])):
        if (
            not isinstance(rule, list)
            or len(rule) != 2
            or not isinstance(rule[0], str)
            or not isinstance(rule[1], list)
        ):
            raise NotACheckpointError(f"{where}: rule {i} is not [regex, [pattern, ...]]: {rule!r}")
        for p in rule[1]:
            parse(p, f"rule {i} ({rule[0]!r}) pattern {p!r}")


_HEX = frozenset("0123456789abcdef")


def _sha256_hex(x: Any) -> bool:
    return isinstance(x, str) and len(x) == 64 and set(x) <= _HEX


def check_consistent(d: Mapping[str, Any], where: str, version: int) -> None:
    """The manifest does not contradict itself: records of a later format version under an
    earlier `format_version`, fingerprint-table digests that are not digests, and rules that map
    a leaf otherwise than the leaf's own record says it was saved (an edited `rules` list would
    restore the values through another pattern, e.g. transposed).

    Raises:
        NotACheckpointError: naming the field that contradicts the rest.
    """
    tables = d.get("tables")
    if tables is not None and (
        not isinstance(tables, Mapping)
        or not all(isinstance(k, str) and k.endswith(".json") for k in tables)
        or not all(_sha256_hex(v) for v in tables.values())
    ):
        raise NotACheckpointError(
            f"{where}: manifest 'tables' is not a map of fingerprint tables to sha256 digests; "
            "the manifest was edited or damaged: restore an earlier checkpoint"
        )
    if version < 2:
        sealed = tables is not None or any(
            isinstance(s, Mapping) and s.get("meta_sha256") is not None
            for a in d["atoms"].values()
            for s in a["slots"].values()
        )
        if sealed:
            raise NotACheckpointError(
                f"{where}: manifest.json says format_version {version}, but it records the "
                "checksums of format version 2 and later: its format_version was edited; "
                "restore an earlier checkpoint"
            )
    _check_rules_agree(d, where)


def _check_rules_agree(d: Mapping[str, Any], where: str) -> None:
    """Every leaf record's `rule` is the rule the manifest's rules give that leaf, and the atoms
    it produced record that rule's patterns."""
    leaves, rules = d.get("leaves", {}), d.get("rules", [])
    if not leaves:
        return
    from ..mapping.rules import CompiledRules

    try:
        compiled = CompiledRules.from_json(rules)
    except UcpError as e:
        raise NotACheckpointError(f"{where}: manifest 'rules' do not compile ({e})") from e
    chosen: dict[str, Any] = {}
    for name, rec in leaves.items():
        if not isinstance(rec, Mapping):
            raise NotACheckpointError(f"{where}: leaf record {name!r} is not an object; damaged")
        rule, base = rec.get("rule"), rec.get("base", name)
        if rule is not None and (type(rule) is not int or not 0 <= rule < len(rules)):
            raise NotACheckpointError(
                f"{where}: leaf {name!r} records rule {rule!r}, but the manifest has "
                f"{len(rules)} rule(s); the manifest was edited or damaged"
            )
        if not isinstance(base, str):
            raise NotACheckpointError(f"{where}: leaf {name!r} base {base!r} is not a string")
        got = compiled.match(base)[0]
        if got != rule:
            said = "no rule" if rule is None else f"rule #{rule} ({rules[rule][0]!r})"
            now = "no rule" if got is None else f"rule #{got} ({rules[got][0]!r}: {rules[got][1]})"
            raise NotACheckpointError(
                f"{where}: leaf {name!r} was saved with {said}, but the manifest's rules give it "
                f"{now}: the manifest contradicts itself (its rules or leaves were edited); "
                "restore an earlier checkpoint"
            )
        chosen[name] = [] if rule is None else rules[rule][1]
    for atom, a in d["atoms"].items():
        want = chosen.get(a.get("leaf", ""))
        if want is not None and a.get("pattern", []) != want:
            raise NotACheckpointError(
                f"{where}: atom {atom!r} records pattern {a.get('pattern')}, but its leaf "
                f"{a.get('leaf')!r} was saved with {want or 'no pattern'}: the manifest "
                "contradicts itself (edited or damaged); restore an earlier checkpoint"
            )
