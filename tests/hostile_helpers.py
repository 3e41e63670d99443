"""Shared by the hostile-input tests: the damaged-checkpoint cases (test_hostile.py,
test_hostile_random.py) mutate copies of one train state saved by `ucp.save`; the importer cases
(test_hostile_safetensors.py, test_hostile_dcp_deepspeed.py) run in a `Box` that checks that a
refused input created nothing and opened nothing outside its source."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import optax
import pytest
from helpers import mesh_of, place, save_layout

from ucp_jax._src.errors import UcpError

# ------------------------------------------------------------------- damaged ucp checkpoints


def hostile_state() -> tuple[dict, object]:
    """The params and adam state every damaged-checkpoint case starts from."""
    params = {
        "a": np.arange(64 * 64, dtype=np.float32).reshape(64, 64),  # 2 chunk files (2 writers)
        "b": (np.arange(64 * 64, dtype=np.float32) * -1.0).reshape(64, 64),  # same shapes as a
        "big": np.arange(512 * 512, dtype=np.float32).reshape(512, 512),  # sharded files
        "s": np.float32(3.5),
    }
    opt = optax.adam(1e-3).init(params)
    return params, opt


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "sandbox" / "ck"
    params, opt = hostile_state()
    # Format version 2 (one file per chunk; still read): the file-level cases target its files.
    # The aggregated layout (version 3) has its own randomized cases (test_hostile_random.py).
    save_layout(path, place(params, mesh_of((2,))), place(opt, mesh_of((2,))), step=5,
                layout="per-array")  # fmt: skip
    return path


# ---------------------------------------------------------------- importers' hostile inputs

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
