"""Hostile and damaged importer/exporter inputs (issue 11): real safetensors files, DCP folders and
DeepSpeed checkpoints, mutated. Each case asserts the exact error class and that it names the file
or tensor; that nothing was created anywhere in the test's folder (its tree is unchanged); and that
nothing outside the source was opened (an audit hook records every file Python opens, and a
"secret" that would import cleanly lies next to the source)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import shutil
import struct
import sys
import types
from collections.abc import Callable, Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from ds.fixtures import TAG, ds_ckpts  # noqa: E402, F401

import ucp_jax as ucp  # noqa: E402
from ucp_jax._src.cli import main  # noqa: E402
from ucp_jax._src.errors import LimitError, MismatchError, UcpError, UnsafePathError  # noqa: E402
from ucp_jax._src.frameworks.common.dcp_files import DCPFormatError, read_metadata  # noqa: E402
from ucp_jax._src.frameworks.dcp.read import import_dcp  # noqa: E402
from ucp_jax._src.frameworks.deepspeed.export import export_deepspeed_universal  # noqa: E402
from ucp_jax._src.frameworks.hf.safetensors import import_safetensors  # noqa: E402
from ucp_jax._src.untrusted.safetensors import SafetensorsError  # noqa: E402
from ucp_jax._src.untrusted.unpickle import STAND_INS, UnsafePickleError, load  # noqa: E402
from ucp_jax.torch import (  # noqa: E402
    DeepSpeedFormatError,
    import_deepspeed,
    import_deepspeed_universal,
)

# ------------------------------------------------------------------------------- the harness

_OPENED: list[list[str]] = []  # stacks of recorders; the audit hook appends to each


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _OPENED and isinstance(args[0], str | bytes):
        p = os.fsdecode(args[0])
        for rec in _OPENED:
            rec.append(os.path.realpath(p))


sys.addaudithook(_audit)


def tree(root: os.PathLike | str) -> set[str]:
    """Every path below root (links not followed), relative."""
    out = set()
    for top, dirs, files in os.walk(root):
        for n in dirs + files:
            out.add(os.path.relpath(os.path.join(top, n), root))
    return out


@dataclasses.dataclass
class Box:
    """A test's folder: `src` (the input), `outside` (a secret next to it), `out` (destination,
    deep enough that `../../../../x` from inside it stays in the box)."""

    root: str
    src: str
    outside: str
    out: str

    @contextlib.contextmanager
    def refused(self, exc: type[BaseException], match: str) -> Iterator[pytest.ExceptionInfo]:
        """The body raises exactly `exc` (message matching), creates nothing, opens no secret."""
        before = tree(self.root)
        rec: list[str] = []
        _OPENED.append(rec)
        try:
            with pytest.raises(UcpError) as info:
                yield info
        finally:
            _OPENED.remove(rec)
        assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
        assert match in str(info.value), str(info.value)
        assert tree(self.root) == before, sorted(tree(self.root) ^ before)
        secret = os.path.realpath(self.outside) + os.sep
        assert not [p for p in rec if p.startswith(secret)], [p for p in rec if secret in p]


@pytest.fixture
def box(tmp_path) -> Box:
    root = tmp_path / "box"
    b = Box(str(root), str(root / "src"), str(root / "outside"),
            str(root / "a" / "b" / "c" / "d" / "e" / "out"))  # fmt: skip
    os.makedirs(b.src)
    os.makedirs(b.outside)
    os.makedirs(os.path.dirname(b.out))
    return b


def test_harness_sees_opens_and_writes(box):
    """The harness itself: a read of the secret and a file written in the box are both caught."""
    secret = os.path.join(box.outside, "secret")
    with open(secret, "w") as f:
        f.write("x")

    def read() -> None:
        with open(secret, "rb"):
            raise UcpError("read it")

    def write() -> None:
        with open(os.path.join(box.root, "a", "stray"), "w"):
            raise UcpError("wrote it")

    with pytest.raises(AssertionError, match="secret"), box.refused(UcpError, ""):
        read()
    with pytest.raises(AssertionError, match="stray"), box.refused(UcpError, ""):
        write()


# ------------------------------------------------------------------------------- safetensors


def save_st(path: str, **tensors: torch.Tensor) -> None:
    st.save_file(tensors, path, metadata={"format": "pt"})


def edit_header(path: str, fn: Callable[[dict], object], *, raw: bytes | None = None) -> None:
    """Rewrite a safetensors header (fn edits the dict in place), keeping the data bytes."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    fn(header)
    text = raw if raw is not None else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def st_src(box: Box) -> str:
    path = os.path.join(box.src, "m.safetensors")
    save_st(path, w=torch.arange(12, dtype=torch.float32).reshape(3, 4), b=torch.ones(4))
    return path


def setter(name: str, key: str, value: object) -> Callable[[dict], None]:
    def fn(h: dict) -> None:
        h[name][key] = value

    return fn


@pytest.mark.parametrize(
    "edit, exc, match",
    [
        (setter("w", "data_offsets", [-16, 0]), SafetensorsError, "tensor 'w'"),
        (setter("w", "data_offsets", [16, 0]), SafetensorsError, "tensor 'w'"),
        (lambda h: h["w"].update(shape=[-1, 4], data_offsets=[16, 0]), SafetensorsError, "'w'"),
        (setter("w", "data_offsets", [0, 10**6]), SafetensorsError, "data_offsets [0, 1000000]"),
        (setter("w", "data_offsets", [0, 32]), SafetensorsError, "hold 48 bytes"),
        (setter("w", "data_offsets", [0]), SafetensorsError, "[begin, end]"),
        (setter("w", "data_offsets", ["0", 48]), SafetensorsError, "data_offsets begin"),
        (setter("w", "data_offsets", [0.0, 48]), SafetensorsError, "data_offsets begin"),
        (setter("w", "shape", [2**40, 2**40]), LimitError, "more than the limit"),
        (setter("w", "shape", [2**62, 2**62, 2**62]), LimitError, "tensor 'w'"),
        (setter("w", "shape", [1000, 1000]), LimitError, "holds only"),
        (setter("w", "shape", [3.0, 4]), SafetensorsError, "non-negative integer"),
        (setter("w", "shape", [True, 12]), SafetensorsError, "non-negative integer"),
        (setter("w", "shape", "12"), SafetensorsError, "expected a shape"),
        (setter("w", "dtype", "F128"), SafetensorsError, "unsupported dtype 'F128'"),
        (setter("w", "dtype", 123), SafetensorsError, "unsupported dtype 123"),
        (lambda h: h.update(w=[1, 2]), SafetensorsError, "tensor 'w': expected"),
        (lambda h: h["w"].pop("shape"), SafetensorsError, "tensor 'w': expected"),
        (lambda h: h.update(__metadata__=[1]), SafetensorsError, "__metadata__"),
    ],
)
def test_safetensors_header_entries(box, edit, exc, match):
    path = st_src(box)
    edit_header(path, edit)
    with box.refused(exc, match) as e:
        import_safetensors(path, box.out)
    assert path in str(e.value)


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests 100000 levels"),
        (b'{"__metadata__": {"a": ' + b"[" * 65 + b"]" * 65 + b"}}", "nests 67 levels"),
        (b"[1, 2]", "header is a JSON array, expected a JSON object"),
        (b"{not json", "not valid JSON"),
    ],
)
def test_safetensors_header_json(box, raw, match):
    path = st_src(box)
    edit_header(path, lambda h: None, raw=raw)
    with box.refused(SafetensorsError, match):
        import_safetensors(path, box.out)


def test_safetensors_header_length(box):
    path = st_src(box)
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", os.path.getsize(path)))
    with box.refused(SafetensorsError, "exceeds the file"):
        import_safetensors(path, box.out)
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 2**63))
    with box.refused(SafetensorsError, "exceeds the file"):
        import_safetensors(path, box.out)


def test_safetensors_truncated(box):
    path = st_src(box)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4)
    with box.refused(SafetensorsError, "tensor 'w'"):
        import_safetensors(path, box.out)
    with open(path, "r+b") as f:
        f.truncate(5)
    with box.refused(SafetensorsError, "too short"):
        import_safetensors(path, box.out)


def test_safetensors_brackets_in_strings_are_no_nesting(box):
    """Neighbour: brackets inside names and metadata strings are text, not depth."""
    path = os.path.join(box.src, "m.safetensors")
    st.save_file({"[[[[w]]": torch.ones(2)}, path, metadata={"x": "[" * 500 + '{"'})
    ck = ucp.open(import_safetensors(path, box.out))
    np.testing.assert_array_equal(ck.read("[[[[w]]"), np.ones(2, np.float32))


def secret_safetensors(box: Box) -> str:
    """A valid safetensors file outside the source: importing it would succeed."""
    path = os.path.join(box.outside, "secret.safetensors")
    save_st(path, secret=torch.full((2,), 7.0))
    return path


def write_index(folder: str, wmap: dict) -> str:
    path = os.path.join(folder, "model.safetensors.index.json")
    with open(path, "w") as f:
        json.dump({"metadata": {}, "weight_map": wmap}, f)
    return path


@pytest.mark.parametrize(
    "name",
    ["../outside/secret.safetensors", "{abs}", "sub/../../outside/secret.safetensors",
     "sub/x\x00.safetensors", "./m.safetensors", ""],
)  # fmt: skip
def test_safetensors_index_outside_the_folder(box, name):
    secret = secret_safetensors(box)
    save_st(os.path.join(box.src, "m.safetensors"), w=torch.ones(2))
    os.makedirs(os.path.join(box.src, "sub"))
    write_index(box.src, {"w": "m.safetensors", "secret": name.format(abs=secret)})
    with box.refused(UnsafePathError, "weight_map file"):
        import_safetensors(box.src, box.out)
    # the index named directly: the same
    with box.refused(UnsafePathError, "weight_map file"):
        import_safetensors(os.path.join(box.src, "model.safetensors.index.json"), box.out)


def test_safetensors_symlinks_refused(box):
    secret = secret_safetensors(box)
    save_st(os.path.join(box.src, "m.safetensors"), w=torch.ones(2))
    os.symlink(secret, os.path.join(box.src, "link.safetensors"))
    # a folder without index: the link is one of its files
    with box.refused(UnsafePathError, "symbolic link"):
        import_safetensors(box.src, box.out)
    # an index naming the link
    write_index(box.src, {"w": "m.safetensors", "secret": "link.safetensors"})
    with box.refused(UnsafePathError, "symbolic link"):
        import_safetensors(box.src, box.out)
    # a linked folder on the way
    os.remove(os.path.join(box.src, "link.safetensors"))
    os.symlink(box.outside, os.path.join(box.src, "sub"))
    write_index(box.src, {"w": "m.safetensors", "secret": "sub/secret.safetensors"})
    with box.refused(UnsafePathError, "symbolic link"):
        import_safetensors(box.src, box.out)
    # the index itself a link (to an index outside)
    write_index(box.outside, {"secret": "secret.safetensors"})
    os.remove(os.path.join(box.src, "model.safetensors.index.json"))
    os.symlink(os.path.join(box.outside, "model.safetensors.index.json"),
               os.path.join(box.src, "model.safetensors.index.json"))  # fmt: skip
    with box.refused(UnsafePathError, "symbolic link"):
        import_safetensors(box.src, box.out)


def test_safetensors_index_damaged(box):
    save_st(os.path.join(box.src, "m.safetensors"), w=torch.ones(2))
    index = os.path.join(box.src, "model.safetensors.index.json")
    for text, match in [('{"weight_map": [1]}', "without a weight_map"),
                        ('{"weight_map": {"w": 3}}', "without a weight_map"),
                        ("[" * 10_000, "nests 10000 levels"), ("{", "not valid JSON")]:  # fmt: skip
        with open(index, "w") as f:
            f.write(text)
        with box.refused(SafetensorsError, match):
            import_safetensors(box.src, box.out)
    write_index(box.src, {"w": "m.safetensors", "v": "missing.safetensors"})
    with box.refused(SafetensorsError, "missing.safetensors"):
        import_safetensors(box.src, box.out)


def test_safetensors_subfolder_in_index_imports(box):
    """Neighbour: an index naming a file in a real subfolder of the source is fine."""
    os.makedirs(os.path.join(box.src, "sub"))
    save_st(os.path.join(box.src, "sub", "m.safetensors"), w=torch.full((2,), 3.0))
    write_index(box.src, {"w": "sub/m.safetensors"})
    np.testing.assert_array_equal(ucp.open(import_safetensors(box.src, box.out)).read("w"), [3, 3])


@pytest.mark.parametrize("name", [".", "..", "", "x" * 300])
def test_tensor_names_that_are_no_atom_folder(box, name):
    path = os.path.join(box.src, "m.safetensors")
    save_st(path, w=torch.ones(2))
    edit_header(path, lambda h: h.update({name: h.pop("w")}))
    with box.refused(UnsafePathError, "as atom"):
        import_safetensors(path, box.out)


# ------------------------------------------------------------------------------------ export

ESCAPES = ["../../../../x", "/tmp/ucp-hostile-x", "a/b", "x\x00y", "..", "a\\b"]


@pytest.fixture
def escaping(box) -> str:
    """An imported checkpoint whose atoms are named like paths that leave the folder."""
    path = os.path.join(box.src, "m.safetensors")
    names = [n for n in ESCAPES if n != ".."] + ["ok.weight"]
    save_st(path, **{f"t{i}": torch.full((2,), float(i)) for i in range(len(names))})
    edit_header(path, lambda h: h.update({n: h.pop(f"t{i}") for i, n in enumerate(names)}))
    return import_safetensors(path, os.path.join(box.root, "ck"))


@pytest.mark.parametrize("bad", [n for n in ESCAPES if n != ".."])
def test_export_atom_names_that_leave_the_folder(box, escaping, bad):
    assert bad in ucp.open(escaping).atoms  # the import quoted it into a safe atom folder
    keep = {bad, "ok.weight"}
    with box.refused(UnsafePathError, repr(bad)):
        export_deepspeed_universal(escaping, box.out, names=lambda a: a if a in keep else None)
    assert not os.path.exists("/tmp/ucp-hostile-x")


@pytest.mark.parametrize("bad", [*ESCAPES, ""])
def test_export_renamed_to_paths_that_leave_the_folder(box, escaping, bad):
    with box.refused(UnsafePathError, "parameter name"):
        export_deepspeed_universal(escaping, box.out, names={"ok.weight": bad}.get)
    with box.refused(UnsafePathError, "parameter name"):
        export_deepspeed_universal(escaping, box.out, names={"ok.weight": bad, **{
            a: None for a in ucp.open(escaping).atoms if a != "ok.weight"}}.get)  # fmt: skip


def test_export_name_collisions(box, escaping):
    with box.refused(MismatchError, "already taken"):
        export_deepspeed_universal(escaping, box.out, names=lambda a: "same")
    with box.refused(MismatchError, "already taken"):
        export_deepspeed_universal(escaping, box.out,
                                   names=lambda a: "optimizer_state.pt" if a == "ok.weight" else None)  # fmt: skip


def test_export_safe_names_still_write(box, escaping):
    """Neighbour: the safe atom exports, at zero/<name>/fp32.pt inside the destination."""
    out = export_deepspeed_universal(
        escaping, box.out, names=lambda a: a if a == "ok.weight" else None, progress=False
    )
    got = load(os.path.join(out, "zero", "ok.weight", "fp32.pt"))
    np.testing.assert_array_equal(got["param"].numpy(), np.full(2, len(ESCAPES) - 1, np.float32))


def test_cli_one_line_errors(box, escaping, capsys):
    assert main(["export", "deepspeed-universal", escaping, box.out]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ucp export:") and err.count("\n") == 1 and "must not hold" in err
    path = st_src(box)
    edit_header(path, setter("w", "data_offsets", [-16, 0]))
    assert main(["convert", "safetensors", path, box.out]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ucp convert:") and err.count("\n") == 1 and "tensor 'w'" in err
    assert not os.path.exists(box.out)


# --------------------------------------------------------------------------------------- DCP


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory) -> str:
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("dcp")
    g = torch.Generator().manual_seed(0)
    sd = {"model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g)},
          "step": 5, "note": {"lr": 0.5}}  # fmt: skip
    with pytest.warns(UserWarning):
        dcp.save(sd, checkpoint_id=root / "d", no_dist=True)
    return str(root / "d")


def dcp_src(box: Box, dcp_folder: str) -> str:
    shutil.rmtree(box.src)
    shutil.copytree(dcp_folder, box.src)
    # the secret: a copy of the real data file outside, which would import cleanly
    for f in os.listdir(box.src):
        if f.endswith(".distcp"):
            shutil.copy(os.path.join(box.src, f), os.path.join(box.outside, f))
    return box.src


def edit_metadata(folder: str, fn: Callable[[object], None]) -> None:
    md = read_metadata(folder)
    fn(md)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def edit_storage(fqn: str, **changes: object) -> Callable[[object], None]:
    def fn(md) -> None:
        for k, info in md.storage_data.items():
            if k.fqn == fqn:
                md.storage_data[k] = dataclasses.replace(info, **changes)

    return fn


def test_dcp_unmodified_imports(box, dcp_folder):
    ck = ucp.open(import_dcp(dcp_src(box, dcp_folder), box.out, progress=False))
    assert ck.step == 5 and ck.atoms["w"].shape == (6, 4)


@pytest.mark.parametrize(
    "fqn, rel",
    [("model.w", "../outside/{f}"), ("model.w", "{abs}"), ("model.w", "x/../../outside/{f}"),
     ("model.w", "{f}\x00"), ("model.b", "/etc/passwd"), ("step", "../outside/{f}"),
     ("model.w", ""), ("model.w", 7)],
)  # fmt: skip
def test_dcp_relative_path_outside(box, dcp_folder, fqn, rel):
    src = dcp_src(box, dcp_folder)
    f = next(x for x in os.listdir(src) if x.endswith(".distcp"))
    if isinstance(rel, str):
        rel = rel.format(f=f, abs=os.path.join(box.outside, f))
    edit_metadata(src, edit_storage(fqn, relative_path=rel))
    with box.refused(UnsafePathError, "relative_path"):
        import_dcp(src, box.out, progress=False)


def test_dcp_symlinks_refused(box, dcp_folder):
    src = dcp_src(box, dcp_folder)
    f = next(x for x in os.listdir(src) if x.endswith(".distcp"))
    os.remove(os.path.join(src, f))
    os.symlink(os.path.join(box.outside, f), os.path.join(src, f))
    with box.refused(UnsafePathError, "symbolic link"):
        import_dcp(src, box.out, progress=False)
    src2 = os.path.join(box.root, "src2")
    os.makedirs(src2)
    shutil.copy(os.path.join(box.outside, f), os.path.join(src2, f))
    os.symlink(os.path.join(src, ".metadata"), os.path.join(src2, ".metadata"))
    with box.refused(UnsafePathError, "symbolic link"):
        import_dcp(src2, box.out, progress=False)


@pytest.mark.parametrize(
    "changes, match",
    [({"offset": 10**9}, "past the end"), ({"length": 10**12}, "past the end"),
     ({"offset": -8}, "non-negative integer"), ({"length": "8"}, "non-negative integer"),
     ({"length": 4}, "expected")],
)  # fmt: skip
def test_dcp_offsets_and_lengths(box, dcp_folder, changes, match):
    src = dcp_src(box, dcp_folder)
    edit_metadata(src, edit_storage("model.w", **changes))
    with box.refused(DCPFormatError, match):
        import_dcp(src, box.out, progress=False)


def _resize(fqn: str, size: list[int], chunk: list[int] | None = None) -> Callable:
    def fn(md) -> None:
        m = md.state_dict_metadata[fqn]
        m.size = torch.Size(size) if all(d >= 0 for d in size) else size
        if chunk is not None:
            m.chunks[0].sizes = chunk

    return fn


@pytest.mark.parametrize(
    "edit, exc, match",
    [(_resize("model.w", [6, -4]), DCPFormatError, "non-negative integer"),
     (_resize("model.w", [2**40, 2**40]), LimitError, "more than the limit"),
     (_resize("model.w", [6, 4], [6, 8]), DCPFormatError, "does not lie inside"),
     (_resize("model.w", [12, 4]), DCPFormatError, "its chunks hold 24 elements"),
     (lambda md: setattr(md, "storage_data", {}), DCPFormatError, "no storage entry"),
     (lambda md: md.state_dict_metadata.update({".": md.state_dict_metadata.pop("model.w")}),
      UnsafePathError, "as atom")],
)  # fmt: skip
def test_dcp_shapes_and_chunks(box, dcp_folder, edit, exc, match):
    src = dcp_src(box, dcp_folder)
    edit_metadata(src, edit)
    with box.refused(exc, match):
        import_dcp(src, box.out, progress=False)


def test_dcp_metadata_not_metadata(box, dcp_folder):
    src = dcp_src(box, dcp_folder)
    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump({"state_dict_metadata": {}}, f)
    with box.refused(DCPFormatError, "expected torch's Metadata"):
        import_dcp(src, box.out, progress=False)


# --------------------------------------------------------------------------------- DeepSpeed


@contextlib.contextmanager
def deepspeed_names() -> Iterator[None]:
    """Pickle ucp's stand-ins under DeepSpeed's own names, as DeepSpeed writes them (without
    importing DeepSpeed): the mutated files are read exactly like DeepSpeed's."""
    fake: dict[str, types.ModuleType] = {}
    saved = []
    for full, cls in STAND_INS.items():
        if not full.startswith("deepspeed."):
            continue
        mod, qual = full.rsplit(".", 1)
        parts = mod.split(".")
        for i in range(1, len(parts) + 1):  # the parents too: pickle imports the top package
            fake.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        setattr(fake[mod], qual, cls)
        saved.append((cls, cls.__module__, cls.__qualname__))
        cls.__module__, cls.__qualname__ = mod, qual
    old = {m: sys.modules.get(m) for m in fake}
    sys.modules.update(fake)
    try:
        yield
    finally:
        for cls, mod, qual in saved:
            cls.__module__, cls.__qualname__ = mod, qual
        for m, v in old.items():
            if v is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = v


def resave(path: str, fn: Callable[[dict], None], big: Callable[[dict], object] | None = None,
           size: int = 10**15) -> None:  # fmt: skip
    """Load a DeepSpeed file weights-only, edit it, save it back with torch.save. `big` picks a
    tensor pickled with `size` elements over its real storage (a hostile size field)."""
    sd = load(path, mmap=False)  # not mapped: the file is overwritten below
    fn(sd)
    target = big(sd) if big else None

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            if obj is target:
                fn_, args = obj.__reduce_ex__(2)
                return fn_, (args[0], args[1], torch.Size([size]), *args[3:])
            return NotImplemented

    module = types.ModuleType("hostile_pickle")
    module.Pickler = Pickler  # type: ignore[attr-defined]
    module.Unpickler = pickle.Unpickler  # type: ignore[attr-defined]
    with deepspeed_names():
        torch.save(sd, path, pickle_module=module)


def ds_src(box: Box, ds_ckpts, name: str = "z1_fp32") -> str:  # noqa: F811
    shutil.rmtree(box.src)
    shutil.copytree(ds_ckpts.zero(name), box.src)
    shutil.copytree(ds_ckpts.zero(name), os.path.join(box.outside, "copy"))  # the secret
    return box.src


def optim(box: Box, dp: int = 0) -> str:
    return os.path.join(box.src, TAG, f"zero_pp_rank_{dp}_mp_rank_00_optim_states.pt")


def model(box: Box) -> str:
    return os.path.join(box.src, TAG, "mp_rank_00_model_states.pt")


def frag(name: str, **kw: int) -> Callable[[dict], None]:
    def fn(sd: dict) -> None:
        f = sd["optimizer_state_dict"]["param_slice_mappings"][0][name]
        for k, v in kw.items():
            setattr(f, k, v)

    return fn


def test_deepspeed_resaved_unmodified_imports(box, ds_ckpts):  # noqa: F811
    """The mutation harness itself: a file loaded and saved back imports bit-exact."""
    src = ds_src(box, ds_ckpts)
    resave(optim(box, 1), lambda sd: None)
    resave(model(box), lambda sd: None)
    ref = ucp.open(import_deepspeed(ds_ckpts.zero("z1_fp32"), box.out + "_ref", progress=False))
    ck = ucp.open(import_deepspeed(src, box.out, progress=False))
    for atom in ref.atoms:
        assert ck.read(atom, "exp_avg").tobytes() == ref.read(atom, "exp_avg").tobytes()


@pytest.mark.parametrize(
    "edit, match",
    [(frag("blocks.0.fc2.weight", start=5920 - 100), "'blocks.0.fc2.weight'"),
     (frag("blocks.0.fc2.weight", numel=10**15), "param_slice_mappings[0]['blocks.0.fc2"),
     (frag("pos", numel=10**15), "'pos' [0, 1000000000000000) overlaps 'emb.weight'"),
     (frag("pos", start=-1), "non-negative integer"),
     (frag("pos", numel=-288), "non-negative integer"),
     (frag("emb.weight", start=288.0), "non-negative integer"),
     (frag("emb.weight", start=10**18), "past the end"),
     (frag("pos", numel=300), "'pos' [0, 300) overlaps 'emb.weight'"),
     (frag("emb.weight", start=1000), "overlaps 'blocks.0.ln1.weight'"),
     (frag("pos", numel=200), "of 'pos' (fp32, TP rank 0) cover 200 of its 288"),
     (lambda sd: sd["optimizer_state_dict"].pop("param_slice_mappings"), "KeyError"),
     (lambda sd: sd["optimizer_state_dict"].update(single_partition_of_fp32_groups=[3]),
      "AttributeError")],
)  # fmt: skip
def test_deepspeed_fragments(box, ds_ckpts, edit, match):  # noqa: F811
    src = ds_src(box, ds_ckpts)
    resave(optim(box, 0), edit)
    with box.refused(DeepSpeedFormatError, match):
        import_deepspeed(src, box.out, progress=False)


def test_deepspeed_truncated_rank_file(box, ds_ckpts):  # noqa: F811
    src = ds_src(box, ds_ckpts)
    with open(optim(box, 1), "r+b") as f:
        f.truncate(os.path.getsize(optim(box, 1)) // 2)
    with box.refused(UnsafePickleError, "not a zip-format torch file"):
        import_deepspeed(src, box.out, progress=False)


def test_deepspeed_partition_larger_than_its_storage(box, ds_ckpts):  # noqa: F811
    """A flat partition whose size field claims 1e15 elements over a 5920-element storage."""
    src = ds_src(box, ds_ckpts)
    resave(optim(box, 1), lambda sd: None,
           big=lambda sd: sd["optimizer_state_dict"]["single_partition_of_fp32_groups"][0])  # fmt: skip
    with box.refused(LimitError, "reaches past its storage"):
        import_deepspeed(src, box.out, progress=False)


@pytest.mark.parametrize(
    "shape, exc, match",
    [([10**9], LimitError, "holds only"), ([10**15], LimitError, "more than the limit"), ([12, -24], DeepSpeedFormatError, "non-negative"),
     ([2**40, 2**40], LimitError, "more than the limit"), ("12", DeepSpeedFormatError, "shape")],
)  # fmt: skip
def test_deepspeed_param_shapes(box, ds_ckpts, shape, exc, match):  # noqa: F811
    src = ds_src(box, ds_ckpts)
    resave(model(box), lambda sd: sd["param_shapes"][0].update(pos=shape))
    with box.refused(exc, match):
        import_deepspeed(src, box.out, progress=False)


@pytest.mark.parametrize("bad", ["..", ".", ""])
def test_deepspeed_parameter_names(box, ds_ckpts, bad):  # noqa: F811
    src = ds_src(box, ds_ckpts)

    def rename(sd: dict) -> None:
        g = sd["param_shapes"][0]
        g[bad] = g.pop("pos")

    resave(model(box), rename)
    with box.refused(UnsafePathError, "as atom"):
        import_deepspeed(src, box.out, progress=False)


@pytest.mark.parametrize("tag", ["../outside/copy/" + TAG, "{abs}", f"x/../../outside/copy/{TAG}",
                                 f"{TAG}\x00", "", ".."])  # fmt: skip
def test_deepspeed_latest_outside(box, ds_ckpts, tag):  # noqa: F811
    src = ds_src(box, ds_ckpts)
    with open(os.path.join(src, "latest"), "w") as f:
        f.write(tag.format(abs=os.path.join(box.outside, "copy", TAG)))
    with box.refused(UnsafePathError, "tag"):
        import_deepspeed(src, box.out, progress=False)


def test_deepspeed_links_refused(box, ds_ckpts):  # noqa: F811
    src = ds_src(box, ds_ckpts)
    outside = os.path.join(box.outside, "copy")
    # a rank file linked to the same file outside
    os.remove(optim(box, 1))
    os.symlink(os.path.join(outside, TAG, os.path.basename(optim(box, 1))), optim(box, 1))
    with box.refused(UnsafePathError, "rank file"):
        import_deepspeed(src, box.out, progress=False)
    # the tag folder a link
    shutil.rmtree(os.path.join(src, TAG))
    os.symlink(os.path.join(outside, TAG), os.path.join(src, TAG))
    with box.refused(UnsafePathError, "symbolic link"):
        import_deepspeed(src, box.out, progress=False)
    with box.refused(UnsafePathError, "symbolic link"):
        import_deepspeed(src, box.out, tag=TAG, progress=False)
    # `latest` a link
    os.remove(os.path.join(src, "latest"))
    os.symlink(os.path.join(outside, "latest"), os.path.join(src, "latest"))
    with box.refused(UnsafePathError, "symbolic link"):
        import_deepspeed(src, box.out, progress=False)


def test_deepspeed_universal_folder(box, ds_ckpts):  # noqa: F811
    shutil.rmtree(box.src)
    shutil.copytree(os.path.dirname(ds_ckpts.universal("z1_fp32")), box.src)
    shutil.copytree(os.path.dirname(ds_ckpts.universal("z1_fp32")), box.outside + "/copy")
    tagdir, zero = os.path.join(box.src, TAG), os.path.join(box.src, TAG, "zero")
    with open(os.path.join(box.src, "latest_universal"), "w") as f:
        f.write("../outside/copy/" + TAG)
    with box.refused(UnsafePathError, "tag"):
        import_deepspeed_universal(box.src, box.out, progress=False)
    # a parameter folder linked outside
    shutil.rmtree(os.path.join(zero, "pos"))
    os.symlink(os.path.join(box.outside, "copy", TAG, "zero", "pos"), os.path.join(zero, "pos"))
    with box.refused(UnsafePathError, "symbolic link"):
        import_deepspeed_universal(tagdir, box.out, progress=False)
    # a slot file named so that its slot is '..'
    os.remove(os.path.join(zero, "pos"))
    shutil.copy(os.path.join(zero, "emb.weight", "fp32.pt"),
                os.path.join(zero, "emb.weight", "...pt"))  # fmt: skip
    with box.refused(UnsafePathError, "slot"):
        import_deepspeed_universal(tagdir, box.out, progress=False)
