"""Patterns: index maps between a leaf (the training program's layout) and its atoms (universal tensors).

A pattern chain maps any box (hyper-rectangle) of a leaf to *pieces*: each piece says which box of
which atom fills which box of the leaf, and how its axes are permuted. Restoring reads the pieces of
the boxes a device needs; saving writes the pieces of the boxes a process owns. No full tensor is
ever needed, and chains compose (a stacked, fused, vocab-padded, transposed leaf is fine).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from ..errors import PatternError
from .boxes import Box, box_shape, box_size, full_box


@dataclasses.dataclass(frozen=True)
class FusedMark:
    """Records that an atom is a fusion of sub-params: `sizes` along atom axis `axis`.

    >>> FusedMark((64, 16, 16), 1).to_json()
    {'sizes': [64, 16, 16], 'axis': 1}
    """

    sizes: tuple[int, ...]
    axis: int

    def to_json(self) -> dict[str, Any]:
        """The mark as the manifest records it (an atom's `fused` list)."""
        return {"sizes": [int(s) for s in self.sizes], "axis": int(self.axis)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FusedMark:
        """The inverse of `to_json`."""
        return cls(tuple(int(s) for s in d["sizes"]), int(d["axis"]))


@dataclasses.dataclass(frozen=True)
class Piece:
    """One box of one atom that fills one box of a leaf.

    `atom` is None for padding (the leaf box is zeros). `axis_map[j]` is the leaf axis of atom axis
    `j`; leaf axes not in `axis_map` are stacked axes of extent 1 in `leaf_box`.
    """

    atom: str | None
    atom_box: Box
    atom_shape: tuple[int, ...]
    leaf_box: Box
    axis_map: tuple[int, ...]
    fused: tuple[FusedMark, ...] = ()

    def atom_to_leaf(self, data: np.ndarray) -> np.ndarray:
        """Turn the atom region's data into the leaf region's layout."""
        order = sorted(range(len(self.axis_map)), key=lambda j: self.axis_map[j])
        if order != list(range(len(order))):
            data = data.transpose(order)
        return data.reshape(box_shape(self.leaf_box))

    def leaf_to_atom(self, data: np.ndarray) -> np.ndarray:
        """Turn the leaf region's data into the atom region's layout (inverse of atom_to_leaf)."""
        present = sorted(self.axis_map)
        lshape = box_shape(self.leaf_box)
        data = data.reshape(tuple(lshape[a] for a in present))
        pos = [present.index(a) for a in self.axis_map]
        if pos != list(range(len(pos))):
            data = data.transpose(pos)
        return data


@dataclasses.dataclass(frozen=True)
class LeafContext:
    """What a pattern may know about the leaf it maps.

    Attributes:
        name: the leaf's name, for messages.
        match: the regex match of its rule (templates expand its groups).
        mesh_axes: mesh axis sizes of the leaf's sharding.
        base: the atom name an identity chain maps to (defaults to `name`; an optimizer moment
            uses its parameter's name).
    """

    name: str
    match: re.Match[str] | None = None
    mesh_axes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    base: str = ""


@dataclasses.dataclass(frozen=True)
class Node:
    """A box of an intermediate array while a leaf box descends the chain towards its atoms."""

    name: str | None
    box: Box
    shape: tuple[int, ...]
    leaf_box: Box
    axis_map: tuple[int, ...]
    env: tuple[tuple[str, int], ...] = ()
    fused: tuple[FusedMark, ...] = ()

    def sub(self, axis: int, start: int, stop: int, inner_start: int, **changes: Any) -> Node:
        """The part [start, stop) of this node along `axis`, placed at `inner_start` inside."""
        la = self.axis_map[axis]
        l0 = self.leaf_box[la][0] + (start - self.box[axis][0])
        leaf_box = _replace(self.leaf_box, la, (l0, l0 + stop - start))
        box = _replace(self.box, axis, (inner_start, inner_start + stop - start))
        return dataclasses.replace(self, box=box, leaf_box=leaf_box, **changes)


def _replace(t: tuple[Any, ...], i: int, v: Any) -> tuple[Any, ...]:
    return (*t[:i], v, *t[i + 1 :])


def _int(value: Any, what: str) -> int:
    """An integer argument of a pattern (`what`: where, for the message); bool and float refused."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise PatternError(
            f"{what}={value!r} is a {type(value).__name__}; expected an integer (an array axis, "
            "a size)"
        )
    return int(value)


def _ints(values: Any, what: str) -> tuple[int, ...]:
    """A sequence of integers (a tuple or list; a string or a single int refused)."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | np.ndarray):
        raise PatternError(
            f"{what}={values!r} is a {type(values).__name__}; expected a tuple of integers"
        )
    return tuple(_int(v, what) for v in values)


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise PatternError(f"{what}={value!r} is a {type(value).__name__}; expected a string")
    return value


def expand_template(template: str, ctx: LeafContext, env: tuple[tuple[str, int], ...]) -> str:
    try:
        name = ctx.match.expand(template) if ctx.match and "\\" in template else template
    except (re.error, IndexError) as e:
        raise PatternError(
            f"leaf {ctx.name!r}: the atom name template {template!r:.80} does not expand with "
            f"its rule's regex groups ({e}); fix the template or the rule's regex"
        ) from e
    for key, val in env:
        name = name.replace("{" + key + "}", str(val))
    return name


class Pattern:
    """Base of all patterns: maps a box of its outer array to boxes of its inner array(s)."""

    kind: ClassVar[str] = "Identity"

    def split(self, node: Node, ctx: LeafContext) -> list[Node]:
        """Map `node` (a box of the outer array) to nodes of the inner array(s)."""
        return [node]

    def to_json(self) -> dict[str, Any]:
        """The pattern as JSON for the manifest."""
        out: dict[str, Any] = {"type": self.kind}
        if not dataclasses.is_dataclass(self):
            return out
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


@dataclasses.dataclass(frozen=True)
class Replicated(Pattern):
    """Identity; on import from torch TP slices, the slices must be equal.

    >>> Replicated().to_json()
    {'type': 'Replicated'}
    """

    kind: ClassVar[str] = "Replicated"


@dataclasses.dataclass(frozen=True)
class Averaged(Pattern):
    """Identity; on import from torch TP slices, the atom is their mean."""

    kind: ClassVar[str] = "Averaged"


@dataclasses.dataclass(frozen=True)
class Partitioned(Pattern):
    """Identity for JAX (the mesh shards it); on import, TP slices concatenate on `axis`."""

    axis: int = 0
    kind: ClassVar[str] = "Partitioned"

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", _int(self.axis, "Partitioned: axis"))


@dataclasses.dataclass(frozen=True)
class Transposed(Pattern):
    """The leaf is `atom.transpose(perm)`; torch Linear `[out, in]` <-> flax `[in, out]` is `(1, 0)`.

    >>> Transposed((1, 0)).to_json()
    {'type': 'Transposed', 'perm': [1, 0]}
    """

    perm: tuple[int, ...] = (1, 0)
    kind: ClassVar[str] = "Transposed"

    def __post_init__(self) -> None:
        object.__setattr__(self, "perm", _ints(self.perm, "Transposed: perm"))
        if sorted(self.perm) != list(range(len(self.perm))):
            raise PatternError(f"Transposed: perm {self.perm} is not a permutation of 0..n-1")

    def split(self, node: Node, ctx: LeafContext) -> list[Node]:
        n = len(node.shape)
        if len(self.perm) != n:
            raise PatternError(
                f"leaf {ctx.name!r}: Transposed{self.perm} needs a {len(self.perm)}-d array but "
                f"found shape {node.shape}; fix the perm or the rule's order"
            )
        shape, box, amap = [0] * n, [(0, 0)] * n, [0] * n
        for j, p in enumerate(self.perm):
            shape[p], box[p], amap[p] = node.shape[j], node.box[j], node.axis_map[j]
        fused = tuple(FusedMark(m.sizes, self.perm[m.axis]) for m in node.fused)
        return [
            dataclasses.replace(
                node, shape=tuple(shape), box=tuple(box), axis_map=tuple(amap), fused=fused
            )
        ]


@dataclasses.dataclass(frozen=True)
class VocabPadded(Pattern):
    """The leaf is the atom zero-padded along `axis` beyond `size`; the atom has `size`.

    >>> VocabPadded(50257, axis=0).to_json()
    {'type': 'VocabPadded', 'size': 50257, 'axis': 0}
    """

    size: int = 0
    axis: int = 0
    kind: ClassVar[str] = "VocabPadded"

    def __post_init__(self) -> None:
        size = _int(self.size, "VocabPadded: size")
        if size < 1:
            raise PatternError(
                f"VocabPadded: size={self.size!r}; expected the true vocabulary, a positive "
                "integer (a size of 0 would make every row padding, stored nowhere)"
            )
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "axis", _int(self.axis, "VocabPadded: axis"))

    def split(self, node: Node, ctx: LeafContext) -> list[Node]:
        ax = _axis(self.axis, node.shape, ctx, self)
        if node.shape[ax] < self.size:
            raise PatternError(
                f"leaf {ctx.name!r}: VocabPadded(size={self.size}, axis={self.axis}) but the array "
                f"has only {node.shape[ax]} along that axis (shape {node.shape}); fix size or axis"
            )
        inner = _replace(node.shape, ax, self.size)
        s, e = node.box[ax]
        out = []
        if s < self.size:
            out.append(node.sub(ax, s, min(e, self.size), s, shape=inner))
        if e > self.size:
            out.append(node.sub(ax, max(s, self.size), e, 0, name=None, shape=inner))
        return out


@dataclasses.dataclass(frozen=True)
class Fused(Pattern):
    """Fused sub-params (QKV, GQA, SwiGLU) whose layout depends on the TP degree.

    Along `axis` the leaf is `concat over r < n of concat_k(sub_k[r-th of n chunks])`, where n is
    the size of mesh axis `shard_axis` of the leaf's sharding (1 if the mesh has no such axis). The
    atom is `concat_k(sub_k)`; with `atoms=(name_k, ...)` each sub-param is its own atom (templates
    expanded like Stacked's).

    >>> Fused((64, 16, 16), axis=1, shard_axis="tensor").to_json()["sizes"]
    [64, 16, 16]
    """

    sizes: tuple[int, ...] = ()
    axis: int = 0
    shard_axis: str | None = None
    atoms: tuple[str, ...] | None = None
    kind: ClassVar[str] = "Fused"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", _ints(self.sizes, "Fused: sizes"))
        if not self.sizes or min(self.sizes) < 1:
            raise PatternError(f"Fused: sizes {self.sizes}; expected positive sub-param sizes")
        object.__setattr__(self, "axis", _int(self.axis, "Fused: axis"))
        if self.shard_axis is not None:
            _name(self.shard_axis, "Fused: shard_axis")
        if self.atoms is not None:
            if isinstance(self.atoms, str) or not isinstance(self.atoms, Sequence):
                raise PatternError(
                    f"Fused: atoms={self.atoms!r}; expected a tuple of names, one per size "
                    f"({len(self.sizes)})"
                )
            object.__setattr__(self, "atoms", tuple(_name(a, "Fused: atoms") for a in self.atoms))
            if len(self.atoms) != len(self.sizes):
                raise PatternError(
                    f"Fused: {len(self.atoms)} atom names for {len(self.sizes)} sizes"
                )

    def split(self, node: Node, ctx: LeafContext) -> list[Node]:
        ax = _axis(self.axis, node.shape, ctx, self)
        n = int(ctx.mesh_axes.get(self.shard_axis, 1)) if self.shard_axis else 1
        total = sum(self.sizes)
        if node.shape[ax] != total:
            raise PatternError(
                f"leaf {ctx.name!r}: Fused(sizes={self.sizes}, axis={self.axis}) expects "
                f"{total} along axis {ax} but the array has shape {node.shape}; fix the sizes or axis"
            )
        if any(sz % n for sz in self.sizes):
            raise PatternError(
                f"leaf {ctx.name!r}: Fused sizes {self.sizes} do not divide by the {n} shards of mesh "
                f"axis {self.shard_axis!r}; use a tensor degree that divides every sub-param"
            )
        offsets = np.cumsum((0, *self.sizes))
        s, e = node.box[ax]
        out: list[Node] = []
        group = total // n  # only the shards r whose [r * group, (r+1) * group) meets the box
        pos, ranks = s // group * group, range(s // group, (e - 1) // group + 1 if e > s else 0)
        for r, k in itertools.product(ranks, range(len(self.sizes))):
            length = self.sizes[k] // n
            lo, hi = max(s, pos), min(e, pos + length)
            if lo < hi:
                base = r * length + (0 if self.atoms else int(offsets[k]))
                changes: dict[str, Any] = {}
                if self.atoms:
                    name = expand_template(self.atoms[k], ctx, node.env)
                    changes = {"name": name, "shape": _replace(node.shape, ax, self.sizes[k])}
                else:
                    changes = {"fused": (*node.fused, FusedMark(self.sizes, ax))}
                out.append(node.sub(ax, lo, hi, base + lo - pos, **changes))
            pos += length
        return _merge(out, ax)


@dataclasses.dataclass(frozen=True)
class Stacked(Pattern):
    """The leaf stacks one atom per layer along `axes` (flat layer index row-major over them).

    `atoms` is a name template expanded with the rule's regex groups (`\\1`), then `{i}` (the
    flat index; `index="e"` names it `{e}`, so Stacked chains nest: layers `{i}`, experts `{e}`).

    >>> Stacked(r"blocks.{i}.experts.{e}.\\1", axes=0, index="e").to_json()["index"]
    'e'
    """

    atoms: str = ""
    axes: int | tuple[int, ...] = 0
    index: str = "i"
    kind: ClassVar[str] = "Stacked"

    def __post_init__(self) -> None:
        _name(self.atoms, "Stacked: atoms")
        _name(self.index, "Stacked: index")
        axes = (
            _ints(self.axes, "Stacked: axes")
            if isinstance(self.axes, Sequence | np.ndarray)
            else (_int(self.axes, "Stacked: axes"),)
        )
        object.__setattr__(self, "axes", axes)
        if len(set(axes)) != len(axes):
            raise PatternError(f"Stacked: repeated axes {axes}")

    def split(self, node: Node, ctx: LeafContext) -> list[Node]:
        assert isinstance(self.axes, tuple)
        axes = [_axis(a, node.shape, ctx, self) for a in self.axes]
        dims = [node.shape[a] for a in axes]
        keep = [j for j in range(len(node.shape)) if j not in axes]
        shape = tuple(node.shape[j] for j in keep)
        box = tuple(node.box[j] for j in keep)
        amap = tuple(node.axis_map[j] for j in keep)
        fused = tuple(FusedMark(m.sizes, keep.index(m.axis)) for m in node.fused)
        out = []
        for idx in itertools.product(*(range(*node.box[a]) for a in axes)):
            env = (*node.env, (self.index, int(np.ravel_multi_index(idx, dims)) if dims else 0))
            leaf_box = node.leaf_box
            for a, v in zip(axes, idx):
                la = node.axis_map[a]
                l0 = node.leaf_box[la][0] + v - node.box[a][0]
                leaf_box = _replace(leaf_box, la, (l0, l0 + 1))
            name = expand_template(self.atoms, ctx, env)
            out.append(Node(name, box, shape, leaf_box, amap, env, fused))
        return out


def _axis(axis: int, shape: tuple[int, ...], ctx: LeafContext, p: Pattern) -> int:
    if not -len(shape) <= axis < len(shape):
        raise PatternError(
            f"leaf {ctx.name!r}: {p.kind} axis {axis} is out of range for shape {shape}; "
            "fix the axis (axes count in the array the pattern sees, from the atom outward)"
        )
    return axis % len(shape)


def _merge(nodes: list[Node], ax: int) -> list[Node]:
    """Join neighbours that are contiguous in both the inner array and the leaf."""
    out: list[Node] = []
    la = nodes[0].axis_map[ax] if nodes else 0
    for nd in nodes:
        prev = out[-1] if out else None
        if (
            prev is not None
            and prev.name == nd.name
            and prev.box[ax][1] == nd.box[ax][0]
            and prev.leaf_box[la][1] == nd.leaf_box[la][0]
        ):
            out[-1] = dataclasses.replace(
                prev,
                box=_replace(prev.box, ax, (prev.box[ax][0], nd.box[ax][1])),
                leaf_box=_replace(prev.leaf_box, la, (prev.leaf_box[la][0], nd.leaf_box[la][1])),
            )
        else:
            out.append(nd)
    return out


PatternChain = tuple[Pattern, ...]


def as_chain(p: Pattern | Sequence[Pattern] | None) -> PatternChain:
    """Normalise a rule's right-hand side to a tuple of patterns (atom outward)."""
    if p is None:
        return ()
    if isinstance(p, Pattern):
        return (p,)
    if not isinstance(p, Sequence) or isinstance(p, str):
        raise PatternError(_not_a_pattern(p))
    chain = tuple(p)
    for q in chain:
        if not isinstance(q, Pattern):
            raise PatternError(_not_a_pattern(q))
    return chain


def _not_a_pattern(q: Any) -> str:
    called = " (a class: call it, e.g. ucp.Replicated())" if isinstance(q, type) else ""
    return (
        f"rule pattern {q!r} is not a ucp pattern{called}; expected a pattern such as "
        "ucp.Fused(...), a tuple of them, or None"
    )


def chain_pieces(
    chain: PatternChain, ctx: LeafContext, leaf_shape: Sequence[int], box: Box
) -> list[Piece]:
    """Map a box of a leaf through a pattern chain to the atom pieces that fill it.

    Args:
        chain: patterns from the atom outward to the leaf.
        ctx: the leaf's name, rule match and mesh axis sizes.
        leaf_shape: the leaf's global shape.
        box: the region of the leaf wanted.

    Returns:
        Pieces covering `box` exactly once (padding pieces have `atom=None`).
    """
    shape = tuple(int(d) for d in leaf_shape)
    nodes = [Node(ctx.base or ctx.name, box, shape, box, tuple(range(len(shape))))]
    for p in reversed(chain):
        nodes = [m for nd in nodes if nd.name is not None for m in p.split(nd, ctx)] + [
            nd for nd in nodes if nd.name is None
        ]
    pieces = [Piece(n.name, n.box, n.shape, n.leaf_box, n.axis_map, n.fused) for n in nodes]
    covered = sum(box_size(p.leaf_box) for p in pieces)
    if covered != box_size(box):  # pragma: no cover - a bug in a pattern, never user error
        raise AssertionError(f"{ctx.name}: pieces cover {covered} of {box_size(box)} elements")
    return pieces


def atom_shapes(chain: PatternChain, ctx: LeafContext, leaf_shape: Sequence[int]) -> dict[str, Any]:
    """All atoms a leaf maps to, with their shapes and fused marks: {name: (shape, fused)}.

    Raises:
        PatternError: two parts of the leaf map to the same place of one atom (a `Stacked`
            template without `{i}`, a name given twice in `Fused(atoms=...)`): one would be lost.
    """
    out: dict[str, Any] = {}
    covered: dict[str, int] = {}
    for p in chain_pieces(chain, ctx, leaf_shape, full_box(leaf_shape)):
        if p.atom is not None:
            out.setdefault(p.atom, (p.atom_shape, p.fused))
            covered[p.atom] = covered.get(p.atom, 0) + box_size(p.atom_box)
    for atom, n in covered.items():
        if n > box_size(full_box(out[atom][0])):
            raise PatternError(
                f"{ctx.name}: its rules map several parts of it to the same elements of atom "
                f"{atom!r} ({n} elements written into {box_size(full_box(out[atom][0]))}), so all "
                "but one would be lost; give each part its own atom (a Stacked template needs "
                "'{i}', Fused(atoms=...) distinct names)"
            )
    return out
