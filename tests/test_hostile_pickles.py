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
