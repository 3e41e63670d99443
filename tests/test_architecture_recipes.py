"""The three recipes of docs/ARCHITECTURE.md, followed once each.

Each toy extension is defined here and touches only the module its recipe names: a pattern
(mapping/patterns.py), an importer (frameworks/common/writer.py, the importers' writing core) and a
redundancy scheme (memory/schemes.py). Everything else (save, restore, the manifest, the
snapshot layout, fetch planning, decoding) must pick it up unchanged.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import jax
import numpy as np
import pytest
from helpers import need_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax as ucp
from ucp_jax._src.mapping import pattern_json, patterns
from ucp_jax._src.memory import schemes

# ------------------------------------------------------------------------ recipe: a new pattern


@dataclasses.dataclass(frozen=True)
class Prefixed(patterns.Pattern):
    """The leaf is the atom with `size` zero rows *before* it along `axis` (VocabPadded's mirror)."""

    size: int = 0
    axis: int = 0
    kind: ClassVar[str] = "Prefixed"

    def split(self, node: Any, ctx: patterns.LeafContext) -> list[Any]:
        ax = self.axis % len(node.shape)
        if node.shape[ax] < self.size:
            raise ucp.PatternError(f"leaf {ctx.name!r}: Prefixed({self.size}) longer than the leaf")
        inner = (*node.shape[:ax], node.shape[ax] - self.size, *node.shape[ax + 1 :])
        s, e = node.box[ax]
        out = []
        if s < self.size:  # the prefix: padding, no atom
            out.append(node.sub(ax, s, min(e, self.size), 0, name=None, shape=inner))
        if e > self.size:
            lo = max(s, self.size)
            out.append(node.sub(ax, lo, e, lo - self.size, shape=inner))
        return out


@pytest.fixture
def prefixed_registered():
    pattern_json.register_pattern(Prefixed)
    yield
    pattern_json._KINDS.pop(Prefixed.kind, None)


def test_recipe_pattern(tmp_path, prefixed_registered):
    need_devices(8)  # its layout or its counts of shards are those of 8 devices
    mesh = jax.make_mesh((4, 2), ("data", "tensor"))
    atom = np.arange(6 * 4, dtype=np.float32).reshape(6, 4) + 1
    leaf = np.concatenate([np.zeros((2, 4), np.float32), atom])  # 8 rows: 2 padding + 6 data
    params = {"w": jax.device_put(leaf, NamedSharding(mesh, P("data", "tensor")))}
    rules = [(r"w", Prefixed(2, axis=0))]
    ucp.save(tmp_path / "ck", params, rules=rules)

    ck = ucp.open(tmp_path / "ck")
    assert ck.atoms["w"].shape == (6, 4)  # the atom has no prefix
    assert ck.atoms["w"].pattern == [{"type": "Prefixed", "size": 2, "axis": 0}]
    np.testing.assert_array_equal(ck.read("w"), atom)

    # onto another mesh, with the rules recorded in the manifest (read back through _KINDS)
    target = {
        "w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, P("tensor")))
    }
    got, _ = ucp.restore(tmp_path / "ck", target)
    np.testing.assert_array_equal(np.asarray(got["w"]), leaf)
    # and as the bare atom, without the pattern
    bare = {"w": jax.ShapeDtypeStruct((6, 4), np.float32, sharding=NamedSharding(mesh, P()))}
    got, _ = ucp.restore(tmp_path / "ck", bare, rules=[(r"w", ())])
    np.testing.assert_array_equal(np.asarray(got["w"]), atom)


# ----------------------------------------------------------------------- recipe: a new importer


def import_npz(src: str, dst: str, *, vocab: dict[str, int] | None = None) -> str:
    """A toy importer: every array of an `.npz` file is an atom (slot fp32); arrays named in
    `vocab` were padded to a multiple and keep only their first `vocab[name]` rows."""
    from ucp_jax._src.frameworks.common.progress import Progress
    from ucp_jax._src.frameworks.common.writer import AtomWriter

    vocab = vocab or {}
    with np.load(src) as z, AtomWriter(dst) as w:
        bar = Progress(False, sum(z[k].nbytes for k in z.files), "npz import")
        for name in z.files:
            a = z[name]
            chain: tuple[patterns.Pattern, ...] = ()
            if name in vocab:
                a, chain = a[: vocab[name]], (patterns.VocabPadded(vocab[name], axis=0),)
            w.atom(name, a.shape, pattern=chain)
            w.write(name, "fp32", tuple((0, d) for d in a.shape), a)
            bar.advance(a.nbytes)
        bar.stop()
        return w.commit(step=7, source={"framework": "npz", "npz": {"path": os.fspath(src)}})


def test_recipe_importer(tmp_path):
    need_devices(8)  # its layout or its counts of shards are those of 8 devices
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((12, 4)).astype(np.float32)  # 10 real rows, padded to 12
    w = rng.standard_normal((4, 6)).astype(np.float32)
    np.savez(tmp_path / "m.npz", emb=emb, w=w)
    out = import_npz(str(tmp_path / "m.npz"), str(tmp_path / "ck"), vocab={"emb": 10})

    ck = ucp.open(out)
    assert ck.step == 7 and ck.manifest.source["framework"] == "npz"
    assert ck.atoms["emb"].shape == (10, 4)
    assert ck.atoms["emb"].pattern == [{"type": "VocabPadded", "size": 10, "axis": 0}]
    np.testing.assert_array_equal(ck.read("emb"), emb[:10])
    # an imported checkpoint restores like a saved one, onto any mesh
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    targets = {
        "emb": jax.ShapeDtypeStruct((16, 4), np.float32, sharding=NamedSharding(mesh, P("data"))),
        "w": jax.ShapeDtypeStruct((4, 6), np.float32, sharding=NamedSharding(mesh, P(None, None))),
    }
    got, _ = ucp.restore(out, targets, rules=[(r"emb", ucp.VocabPadded(10))])
    np.testing.assert_array_equal(np.asarray(got["emb"])[:10], emb[:10])
    assert not np.asarray(got["emb"])[10:].any()
    np.testing.assert_array_equal(np.asarray(got["w"]), w)


# ---------------------------------------------------------------- recipe: a new redundancy scheme


class NextMirror(schemes.RedundancyScheme):
    """Toy scheme: each node keeps a verbatim copy of the previous node's whole pieces part in a
    redundancy area after its own (replica without the interleaving)."""

    name = "toy-mirror"

    def default_group_size(self, nodes: int) -> int:
        return 2

    @staticmethod
    def prev(layout: Any, n: int) -> int:
        g = layout.group_of[n]
        return g[(g.index(n) - 1) % len(g)]

    @staticmethod
    def next(layout: Any, n: int) -> int:
        g = layout.group_of[n]
        return g[(g.index(n) + 1) % len(g)]

    def extra_bytes(self, layout: Any, node: int) -> int:
        return layout.primary[self.prev(layout, node)] if len(layout.group_of[node]) > 1 else 0

    def needs(self, layout: Any, node: int) -> list[schemes.Need]:
        if len(layout.group_of[node]) < 2:
            return []
        base = layout.primary[node]
        return [
            (p, 0, p.nbytes, base + p.offset, False)
            for p in layout.by_node[self.prev(layout, node)]
        ]

    def decodable(self, layout: Any, lost: int, present: Any) -> bool:
        return self.next(layout, lost) in present

    def decode_ranges(self, layout: Any, lost: int, present: Any) -> list[tuple[int, int, int]]:
        h = self.next(layout, lost)
        return [(h, layout.primary[h], layout.primary[lost])]

    def decode(self, layout: Any, lost: int, blobs: Any) -> np.ndarray:
        h = self.next(layout, lost)
        return np.array(blobs[h].view(layout.primary[h], layout.primary[lost]))


@pytest.fixture
def mirror_registered():
    schemes.register_scheme(NextMirror())
    yield
    schemes.SCHEMES.pop(NextMirror.name, None)


@pytest.mark.parametrize("nodes", [2, 4, 5])
def test_recipe_redundancy_scheme(nodes, mirror_registered, tmp_path):
    # the same simulated job (fake devices, many nodes in one process) as test_memory_layout
    from test_memory_layout import _check_pieces, _job, _View

    from ucp_jax._src.memory import recovery
    from ucp_jax._src.memory.redundancy import decode_node, decode_ranges

    layout, arrays, blobs = _job(nodes, NextMirror.name, 2)
    assert layout.redundancy == NextMirror.name
    for lost in range(nodes):
        group = layout.group_of[lost]
        others = {m: _View(blobs[m]) for m in group if m != lost}
        decoded = decode_node(layout, lost, others)
        _check_pieces(layout, arrays, lost, decoded)  # every piece of the lost node, bit-exact
        assert recovery._decodable(layout, lost, set(range(nodes)) - {lost})
        present = set(range(nodes)) - {lost}
        assert all(n in group and n != lost for n, _, _ in decode_ranges(layout, lost, present))

    # the snapshot manager takes it by name; validation and the default group size come from it
    mgr = ucp.memory.SnapshotManager(None, redundancy=NextMirror.name, shm_dir=tmp_path)
    try:
        assert mgr.redundancy == NextMirror.name
    finally:
        mgr.free(all_nodes=True)
    with pytest.raises(ValueError, match="redundancy"):
        ucp.memory.SnapshotManager(None, redundancy="no-such-scheme", shm_dir=tmp_path)
