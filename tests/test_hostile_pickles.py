"""Pickles built to exhaust memory: refused before anything is allocated, naming the file.

A few bytes of pickle can ask C's unpickler for gigabytes (a memo index of 2**28 sizes its memo
by it; `bytearray(6e9)` through an allowed global), and a few MB of deflated zeros inflate to a
3 GB data.pkl. Each loader here (the lazy reader of DeepSpeed rank files, torch's weights-only
route, the DCP .metadata reader) refuses them with UnsafePickleError, the file named.
"""

from __future__ import annotations

import pickle
import struct
import zipfile

import pytest

from ucp_jax._src.untrusted import unpickle
from ucp_jax._src.untrusted.lazy import load_lazy
from ucp_jax._src.untrusted.unpickle import UnsafePickleError, load, load_pickle

MEMO_BOMB = b"\x80\x02N" + b"r" + struct.pack("<I", 2**28) + b"."  # LONG_BINPUT 2**28


class _Sized:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return bytearray, (6_000_000_000,)


def _torch_zip(path, data_pkl: bytes, compress: int = zipfile.ZIP_STORED) -> str:
    with zipfile.ZipFile(path, "w", compress) as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return str(path)


@pytest.mark.parametrize("loader", [load_lazy, load])
def test_a_memo_index_bomb_is_refused(tmp_path, loader):
    path = _torch_zip(tmp_path / "x.pt", MEMO_BOMB)
    with pytest.raises(UnsafePickleError, match=r"x.pt: .*memo entry 268435456 after 0 entries"):
        loader(path)


def test_a_memo_index_bomb_in_plain_pickle_metadata_is_refused(tmp_path):
    (tmp_path / ".metadata").write_bytes(MEMO_BOMB)
    with pytest.raises(UnsafePickleError, match=r"\.metadata: .*memo entry 268435456"):
        load_pickle(tmp_path / ".metadata", {})
    # neighbour: a real pickle with memo entries loads
    (tmp_path / "ok").write_bytes(pickle.dumps([{"a": 1}, {"a": 1}] * 3000, protocol=2))
    assert load_pickle(tmp_path / "ok", {}) == [{"a": 1}, {"a": 1}] * 3000


def test_a_bytearray_of_a_length_is_refused(tmp_path):
    path = _torch_zip(tmp_path / "b.pt", pickle.dumps(_Sized(), protocol=3))
    with pytest.raises(UnsafePickleError, match=r"b.pt: bytearray\(6000000000,\): only"):
        load_lazy(path)
    ok = _torch_zip(tmp_path / "ok.pt", pickle.dumps(bytearray(b"abc"), protocol=3))
    assert load_lazy(ok) == bytearray(b"abc")


@pytest.mark.parametrize("loader", [load_lazy, load])
def test_a_zip_bomb_data_pkl_is_refused_before_it_inflates(tmp_path, monkeypatch, loader):
    monkeypatch.setattr(unpickle, "MAX_PICKLE_BYTES", 1 << 20)
    path = _torch_zip(tmp_path / "z.pt", b"\x80\x02N" + b"\x00" * (4 << 20) + b".",
                      zipfile.ZIP_DEFLATED)  # fmt: skip
    with pytest.raises(UnsafePickleError, match=r"z.pt: its archive/data.pkl holds 4194308 bytes"):
        loader(path)


# ------------------------------------------------------------------------- expanded tensors


def _expanded_bomb(path) -> str:
    """1.5 KB of torch file: one float, expanded (stride 0) to 65536 x 65536 (16 GiB)."""
    torch = pytest.importorskip("torch")
    torch.save(torch.zeros(1).expand(1 << 16, 1 << 16), path)
    return str(path)


@pytest.mark.parametrize("loader", ["lazy", "weights_only", "bytes"])
def test_an_expanded_tensor_bomb_is_refused_before_it_is_read(tmp_path, loader):
    # reading an expanded view copies every repeat: 16 GiB from 1.5 KB of file
    from ucp_jax._src.errors import LimitError

    path = _expanded_bomb(tmp_path / "step.pt")
    with pytest.raises(LimitError, match=r"step.pt: a tensor of shape \[65536, 65536\] \(stride "
                       r"\[0, 0\]\) repeats the 1 element\(s\) of its storage into 17179869184"):  # fmt: skip
        if loader == "lazy":
            load_lazy(path)
        elif loader == "weights_only":
            load(path)
        else:
            with open(path, "rb") as f:
                unpickle.loads(f.read(), where=path)


@pytest.mark.parametrize("loader", ["lazy", "weights_only"])
def test_small_expanded_views_still_load(tmp_path, loader):
    # what models save: a position_ids buffer (arange(n).expand((1, -1))), a broadcast row;
    # and a list that holds itself (the check walks it once)
    torch = pytest.importorskip("torch")
    import numpy as np

    cyclic: list = [torch.ones(3)]
    cyclic.append(cyclic)
    sd = {"position_ids": torch.arange(16).expand((1, -1)), "row": torch.ones(4).expand(8, 4),
          "cyclic": cyclic}  # fmt: skip
    torch.save(sd, tmp_path / "m.pt")
    got = (load_lazy if loader == "lazy" else load)(tmp_path / "m.pt")
    np.testing.assert_array_equal(got["position_ids"].numpy(), np.arange(16)[None])
    np.testing.assert_array_equal(got["row"].numpy(), np.ones((8, 4), np.float32))
    assert got["cyclic"][1] is got["cyclic"]
