"""Hostile and damaged importer/exporter inputs (issue 11), safetensors side: real safetensors
files (headers, indexes, links, tensor names) mutated, and exports of atoms named like paths that
leave the folder. Each case asserts the exact error class and that it names the file or tensor;
that nothing was created anywhere in the test's folder (its tree is unchanged); and that nothing
outside the source was opened (an audit hook records every file Python opens, and a "secret" that
would import cleanly lies next to the source). DCP and DeepSpeed inputs are in
test_hostile_dcp_deepspeed.py.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from hostile_helpers import Box  # noqa: E402
from hostile_helpers import box as box  # noqa: E402  (the fixture)

import ucp_jax as ucp  # noqa: E402
from ucp_jax._src.cli import main  # noqa: E402
from ucp_jax._src.errors import LimitError, MismatchError, UcpError, UnsafePathError  # noqa: E402
from ucp_jax._src.frameworks.deepspeed.export import export_deepspeed_universal  # noqa: E402
from ucp_jax._src.frameworks.hf.safetensors import import_safetensors  # noqa: E402
from ucp_jax._src.untrusted.safetensors import SafetensorsError  # noqa: E402
from ucp_jax._src.untrusted.unpickle import load  # noqa: E402

# ------------------------------------------------------------------------------- the harness


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
        # a tensor aliasing another's bytes (the safetensors library refuses it: 'invalid offset')
        (
            lambda h: h["b"].update(
                data_offsets=[h["w"]["data_offsets"][0], h["w"]["data_offsets"][0] + 16]
            ),
            SafetensorsError,
            "share bytes",
        ),
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


def test_safetensors_header_naming_a_tensor_twice(box):
    """A header naming `w` twice, the second covering only part of the first's bytes: Python's
    json keeps the last (it imported as 4 of w's 12 values); the safetensors library refuses the
    file (the bytes only the first entry held are then no tensor's). Refused by name here too."""
    path = st_src(box)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    begin = header["w"]["data_offsets"][0]
    second = json.dumps({"dtype": "F32", "shape": [4], "data_offsets": [begin, begin + 16]})
    raw = json.dumps(header).encode()[:-1] + b', "w": ' + second.encode() + b"}"
    edit_header(path, lambda h: None, raw=raw)
    with pytest.raises(Exception, match="not fully covered"):  # the referee
        st.load_file(path)
    with box.refused(SafetensorsError, "names the key 'w' twice"):
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


def test_special_files_in_a_source_folder_are_refused(box):
    """A FIFO where a safetensors file or config.json should be blocked whoever opened it."""
    import signal

    signal.alarm(60)  # a regression hangs: fail instead
    try:
        save_st(os.path.join(box.src, "a.safetensors"), w=torch.ones(2))
        os.mkfifo(os.path.join(box.src, "b.safetensors"))
        with box.refused(UnsafePathError, "b.safetensors: safetensors file is a FIFO"):
            import_safetensors(box.src, box.out)
        from ucp_jax._src.hf_config import read_config_json
        from ucp_jax._src.llama_config import HFConfigError

        os.mkfifo(os.path.join(box.root, "config.json"))
        with pytest.raises(HFConfigError, match=r"config.json: .* is a FIFO, not a regular file"):
            read_config_json(os.path.join(box.root, "config.json"), "model config")
    finally:
        signal.alarm(0)


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
