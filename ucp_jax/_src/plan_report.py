"""A restore plan you can read before you load: `ucp.plan` checks targets against the manifest only.

It binds the targets as `restore` does and resolves every leaf against the manifest, collecting
every problem instead of stopping at the first: leaves missing from the checkpoint (with the
closest unread atoms and a `Renamed` rule that would map them), shape, dtype, pattern, slot and
PRNG key impl mismatches. It also says what a restore would read: the bytes each process reads
(from the targets' shardings, for every process of the job) and this process's peak host memory.
No array is opened and nothing but the manifest is read. `restore` runs the same plan first and
raises `RestorePlanError` listing every problem.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Sequence
from typing import Any

import jax

from .checkpoint import Checkpoint
from .errors import MismatchError, PatternError, RestorePlanError, check_inflight_bytes
from .mapping.binding import LeafBinding, bind_state
from .mapping.boxes import box_size, index_to_box
from .mapping.rename import Renamed
from .mapping.rules import CompiledRules, Rule
from .mapping.slots import OPT_PREFIX
from .resolve import resolve_leaf
from .util import config
from .util.dtypes import np_dtype


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing that stops a restore.

    Attributes:
        leaf: the target leaf ('' for problems of the rules themselves).
        kind: 'missing', 'shape', 'dtype', 'pattern', 'slot', 'key_impl', 'target', 'rule', ...
        message: the full message (what was expected, what was found, the fix).
        close: for 'missing': the closest atoms no other leaf reads.
    """

    leaf: str
    kind: str
    message: str
    close: tuple[str, ...] = ()


@dataclasses.dataclass
class RestorePlan:
    """What `restore(path, targets)` would do, found from the manifest alone.

    Attributes:
        path, step: the checkpoint.
        matched: target leaves that resolve (atom, shape, dtype, pattern all fit).
        problems: everything that does not fit, each with its fix (`missing` is a subset).
        unexpected: atoms of the checkpoint that no target leaf reads (fine for a partial
            restore, e.g. params only; a renamed module shows up here and in `missing`).
        suggested_rules: rules (regex, pattern) that would map missing leaves to unread atoms.
        bytes_per_process: process index -> bytes it reads (from the stored dtypes).
        reads: region reads this process issues.
        peak_host_bytes: this process's estimated peak host memory for the restore (reads in
            flight are bounded by `max_inflight_bytes`; on CPU devices the restored arrays are
            host memory too and come on top: `bytes_needed`).
        bytes_needed: bytes of the regions this process's devices hold, in the targets' dtypes.
    """

    path: str
    step: int | None
    matched: list[str] = dataclasses.field(default_factory=list)
    problems: list[Problem] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)
    suggested_rules: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    bytes_per_process: dict[int, int] = dataclasses.field(default_factory=dict)
    reads: int = 0
    peak_host_bytes: int = 0
    bytes_needed: int = 0
    resolved: list[Any] = dataclasses.field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        """Whether a restore would go through (no problems)."""
        return not self.problems

    @property
    def missing(self) -> list[Problem]:
        """The problems of target leaves the checkpoint has no atom for."""
        return [p for p in self.problems if p.kind == "missing"]

    def __str__(self) -> str:
        mib = 2**20
        lines = [
            f"restore plan for {self.path} (step {self.step}): {len(self.matched)} leaves match, "
            f"{len(self.problems)} problem(s), {len(self.unexpected)} atom(s) not read"
        ]
        for p in self.problems:
            lines.append(f"  - [{p.kind}] {p.message}")
        if self.suggested_rules:
            lines.append("  rules that would map the missing leaves (pass rules=[...]):")
            lines += [f"    ({rx!r}, ucp.{pat!r})," for rx, pat in self.suggested_rules]
        if self.unexpected:
            more = len(self.unexpected) - 8
            lines.append(
                f"  not read: {', '.join(self.unexpected[:8])}"
                + (f" (+{more})" if more > 0 else "")
            )
        per = ", ".join(
            f"p{k}: {v / mib:.1f} MiB" for k, v in sorted(self.bytes_per_process.items())
        )
        lines.append(
            f"  reads: {per or 'nothing'}; this process: {self.reads} region reads, peak host "
            f"memory ~{self.peak_host_bytes / mib:.1f} MiB"
        )
        return "\n".join(lines)

    def raise_if_problems(self) -> None:
        """Raise one `RestorePlanError` listing every problem (nothing when `ok`)."""
        if self.problems:
            raise RestorePlanError(str(self), self)


def plan(
    path: Any,
    params_target: Any,
    opt_state_target: Any = None,
    *,
    rules: Sequence[Rule] = (),
    cast: bool = False,
    max_inflight_bytes: int | None = None,
) -> RestorePlan:
    """What `ucp.restore` with these arguments would do, read from the manifest alone.

    Args:
        path: a committed universal checkpoint (local path or kvstore URL), as for `ucp.restore`.
        params_target: pytree of jax.ShapeDtypeStruct with `.sharding` (or concrete arrays).
        opt_state_target: optax state of the same kind, or None.
        rules: (regex, pattern) pairs for the target layout; when empty, the rules recorded at
            save time are used.
        cast: allow converting the stored dtype to the target's.
        max_inflight_bytes: the read budget a restore would use (for the peak host memory).

    Returns:
        A RestorePlan: `print(plan)` for the report, `.ok`, `.problems`, `.suggested_rules`,
        `.bytes_per_process`, `.peak_host_bytes`.

    >>> report = ucp.plan("/tmp/ckpt/step_10", params_target, opt_target)  # doctest: +SKIP
    >>> print(report)  # doctest: +SKIP
    """
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint(path)
    compiled = CompiledRules(rules) if rules else CompiledRules.from_json(ckpt.manifest.rules)
    pbind, obind = bind_state(params_target, opt_state_target, compiled)
    max_inflight_bytes = check_inflight_bytes(max_inflight_bytes, "plan")
    budget = config.inflight_bytes() if max_inflight_bytes is None else max_inflight_bytes
    return build(ckpt, pbind + obind, compiled if rules else None, cast, budget)


def build(ckpt: Checkpoint, bindings: Sequence[LeafBinding], given: CompiledRules | None,
          cast: bool, budget: int, *, account: bool = True) -> RestorePlan:  # fmt: skip
    """The plan of bound target leaves (`restore` calls it with its own bindings).

    `account=False` leaves out the byte accounting (a restore only needs the problems).
    """

    out = RestorePlan(ckpt.path, ckpt.step)
    if given is not None:
        try:
            given.check_all_used([b.name for b in bindings])
        except PatternError as e:
            out.problems.append(Problem("", "rule", str(e)))
    for b in bindings:
        try:
            r = resolve_leaf(ckpt, b, cast, read=False)
        except (MismatchError, PatternError) as e:
            out.problems.append(Problem(b.name, getattr(e, "kind", None) or "mismatch", str(e)))
            continue
        out.matched.append(b.name)
        out.resolved.append(r)
    used = {a for r in out.resolved for a in r.atom_of.values()}
    out.unexpected = sorted(a for a in ckpt.atoms if a not in used)
    _other_params(out, ckpt, bindings)
    _suggest(out, bindings)
    if account:
        _account(out, ckpt, budget)
    return out


def _other_params(out: RestorePlan, ckpt: Checkpoint, bindings: Sequence[LeafBinding]) -> None:
    """One problem first when the optax state target mirrors other params than the params
    target (built from the full params, restored into a subset): its leaves of parameters the
    params target lacks are then not slots, and their own messages do not say why."""
    if not any(p.leaf.startswith(OPT_PREFIX + ".") for p in out.problems):
        return
    params = {b.base for b in bindings if b.kind == "param"}
    strays = set()
    for b in bindings:
        if b.kind != "opt" or b.role is None:
            continue
        parts = b.name.split(".")
        for i in range(2, len(parts)):
            tail = ".".join(parts[i:])
            atom = ckpt.atoms.get(tail)
            if atom is not None and tail not in params and len(atom.slots) > 1:
                strays.add(tail)
                break
    if strays:
        names = sorted(strays)
        out.problems.insert(
            0,
            Problem(
                OPT_PREFIX,
                "tree",
                (
                    f"restore: the optax state target holds state of parameter(s) {names[:4]}"
                    + (f" (+{len(names) - 4})" if len(names) > 4 else "")
                    + ", which the params target does not have: it was built for other params; build "
                    "it from the params target (jax.eval_shape(optimizer.init, params_target))"
                ),
            ),
        )


def _suggest(out: RestorePlan, bindings: Sequence[LeafBinding]) -> None:
    """Closest unread atoms of each missing leaf, and `Renamed` rules for renamed modules."""
    by_name = {b.name: b for b in bindings}
    rules: dict[str, Any] = {}
    fixed = []
    for p in out.problems:
        b = by_name.get(p.leaf)
        if p.kind != "missing" or b is None:
            fixed.append(p)
            continue
        close = tuple(difflib.get_close_matches(b.base, out.unexpected, n=3, cutoff=0.5))
        fixed.append(dataclasses.replace(p, close=close))
        if close and b.kind == "param" and b.rule is None:
            rule = _rename_rule(b.base, close[0])
            if rule is not None:
                rules.setdefault(rule[0], rule[1])
    out.problems = fixed
    out.suggested_rules = list(rules.items())


def _rename_rule(leaf: str, atom: str) -> tuple[str, Renamed] | None:
    """The rule renaming the module a leaf and an atom differ in (their common tail kept).

    >>> _rename_rule("encoder.dense.kernel", "encoder.linear.kernel")
    ('encoder\\\\.dense\\\\.(.*)', Renamed(atom='encoder.linear.\\\\1'))
    """
    a, b = leaf.split("."), atom.split(".")
    k = 0
    while k < min(len(a), len(b)) - 1 and a[-1 - k] == b[-1 - k]:
        k += 1
    if k == 0:
        return None
    head, new = ".".join(a[: len(a) - k]), ".".join(b[: len(b) - k])
    return re.escape(head) + r"\.(.*)", Renamed(new + r".\1")


def _account(out: RestorePlan, ckpt: Checkpoint, budget: int) -> None:
    """Bytes each process reads, this process's reads and peak host memory (no array opened)."""
    me = jax.process_index()
    per: dict[int, int] = {}
    biggest = 0
    for r in out.resolved:
        b = r.binding
        if b.sharding is None:
            boxes = {p: [g.box for g in r.groups] for p in range(jax.process_count())}
        else:
            boxes = {}
            for dev, index in b.sharding.devices_indices_map(b.shape).items():
                box = index_to_box(index, b.shape)
                seen = boxes.setdefault(dev.process_index, [])
                if box not in seen:
                    seen.append(box)
        for proc, bxs in boxes.items():
            for box in bxs:
                pieces = b.pieces(box)
                per[proc] = per.get(proc, 0) + sum(
                    box_size(p.atom_box) * _itemsize(ckpt, r, p.atom) for p in pieces if p.atom
                )
                if proc == me:
                    out.reads += sum(1 for p in pieces if p.atom is not None)
        need = sum(box_size(g.box) for g in r.groups) * b.dtype.itemsize
        out.bytes_needed += need
        biggest = max(biggest, need)
    out.bytes_per_process = per
    out.peak_host_bytes = min(out.bytes_needed, max(budget, 1) + biggest)


def _itemsize(ckpt: Checkpoint, r: Any, atom: str) -> int:
    name, slot = r.atom_of[atom], r.slot_of[atom]
    return np_dtype(ckpt.atoms[name].slots[slot].dtype).itemsize


__all__ = ["Problem", "RestorePlan", "build", "plan"]
