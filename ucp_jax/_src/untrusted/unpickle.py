"""Weights-only loading of torch files (DeepSpeed checkpoints included) with an explicit allow-list.

ucp_jax never runs code from a checkpoint file. Every `.pt` file is read in two gates:

1. the pickle's opcodes are scanned (nothing is executed) and every global it names must be on
   the allow-list below, else `UnsafePickleError` names the global;
2. the file is then loaded by `torch.load(weights_only=True)`, torch's own restricted unpickler,
   with stand-ins registered for the few DeepSpeed classes found in its pickles (loss scaler,
   fragment address, ZeRO stage enum, sub-param shape). The stand-ins are plain data holders
   defined here: DeepSpeed is neither imported nor needed.

>>> sd = load("ckpt/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import os
import pickle
import pickletools
import threading
import zipfile
from collections.abc import Iterator
from typing import Any

from ..errors import UnsafePathError
from ..errors import UnsafePickleError as UnsafePickleError
from .limits import check_expanded
from .paths import open_regular

# ----------------------------------------------------------------------------- the stand-ins


class _Record:
    """A stand-in object: holds the attributes the pickle sets, runs nothing."""

    _ds_name = ""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{self._ds_name.rsplit('.', 1)[-1]}({fields})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    __hash__ = None  # type: ignore[assignment]


class LossScaler(_Record):
    """Stands in for deepspeed.runtime.fp16.loss_scaler.LossScaler (cur_scale, dynamic)."""

    _ds_name = "deepspeed.runtime.fp16.loss_scaler.LossScaler"


class DynamicLossScaler(_Record):
    """Stands in for deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler."""

    _ds_name = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


@dataclasses.dataclass
class FragmentAddress:
    """Stands in for deepspeed.utils.tensor_fragment.fragment_address: a flat [start, start+numel)."""

    numel: int = 0
    start: int = 0


@dataclasses.dataclass
class SubparamShape:
    """Stands in for deepspeed.checkpoint.universal_checkpoint.SubparamShape."""

    patterns: Any = None
    shape: Any = None
    partition_dim: int = 0


class ZeroStageEnum(enum.IntEnum):
    """Stands in for deepspeed.runtime.zero.config.ZeroStageEnum."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3  # alias of weights, as in DeepSpeed


class EnumValue(_Record):
    """Stands in for a member of an enum named in a pickle (a pickled enum member is its class
    called with its value): holds the value, imports and runs nothing of the enum's module."""

    def __init__(self, value: Any = None) -> None:
        self.value = value


def _enum_stand_ins(names: list[str]) -> dict[str, Any]:
    """One `EnumValue` class per enum name (`repr`: `AttnBackend(value=5)`)."""
    return {n: type(n.rsplit(".", 1)[-1], (EnumValue,), {"_ds_name": n}) for n in names}


# Enums found in Megatron-LM's `args` (a Namespace pickled into every checkpoint it saves):
# `attention_backend` (AttnBackend), `exit_signal` (signal.Signals), and the other enums of
# megatron-core's enum modules that its options take.
_ENUMS = [
    "signal.Signals",
    *(f"megatron.core.enums.{c}" for c in ("ModelType", "Fp8Recipe", "Fp4Recipe")),
    *(f"megatron.core.transformer.enums.{c}" for c in (
        "ModelType", "LayerType", "AttnType", "AttnMaskType", "AttnBackend", "CudaGraphModule",
        "CudaGraphScope", "InferenceCudaGraphScope")),
    "megatron.training.checkpointing.CheckpointType",
]  # fmt: skip


def _np_reconstruct(*args: Any) -> Any:
    """numpy's ndarray reconstructor (Megatron rng states); builds an array, runs nothing else."""
    import numpy as np

    return np.ndarray.__new__(*args)


# Names a pickle may ask for, beyond what torch's weights-only unpickler allows by itself.
STAND_INS: dict[str, Any] = {
    LossScaler._ds_name: LossScaler,
    DynamicLossScaler._ds_name: DynamicLossScaler,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
    "deepspeed.checkpoint.universal_checkpoint.SubparamShape": SubparamShape,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageEnum,
    "argparse.Namespace": __import__("argparse").Namespace,  # Megatron's `args`
    **_enum_stand_ins(_ENUMS),
}


def numpy_globals() -> dict[str, Any]:
    import numpy as np

    out: dict[str, Any] = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out[f"{mod}._reconstruct"] = _np_reconstruct
    return out


def _torch_default_globals() -> frozenset[str]:
    """What torch's weights-only unpickler resolves by itself (tensors, storages, dtypes, ...)."""
    try:
        from torch import _weights_only_unpickler as w

        return frozenset(w._get_allowed_globals())
    except (ImportError, AttributeError):  # pragma: no cover - a torch without the private table
        return frozenset(
            {"collections.OrderedDict", "torch.Size", "torch._utils._rebuild_tensor_v2"}
        )


def allowed(name: str) -> bool:
    """Whether a pickle may name this global ('module.qualname').

    >>> allowed("torch._utils._rebuild_tensor_v2"), allowed("os.system")
    (True, False)
    """
    return name in STAND_INS or name in numpy_globals() or name in _torch_default_globals()


# --------------------------------------------------------------------------- gate 1: the scan


MAX_PICKLE_BYTES = 256 << 20  # a pickle of metadata (tensor bytes live beside it)
MEMO_SLACK = 1024  # memo indices may run this far ahead of the entries stored


_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING",
               "BINSTRING", "STRING"}  # fmt: skip
_REFUSED_OPS = {"EXT1", "EXT2", "EXT4"}  # the copyreg extension registry: names hidden by number


def pickle_globals(data: bytes) -> list[str]:
    """Every global a pickle names, in order, found by reading its opcodes (nothing is run).

    Raises:
        UnsafePickleError: a global whose name cannot be read statically, or an extension code.
    """
    out: list[str] = []
    memo: dict[int, Any] = {}
    recent: list[Any] = []  # values of the last pushes, for STACK_GLOBAL
    next_memo = 0
    for op, arg, _pos in pickletools.genops(data):
        if op.name in ("BINPUT", "LONG_BINPUT", "PUT") and int(arg or 0) > next_memo + MEMO_SLACK:
            # picklers number memo entries 0, 1, 2...; C's unpickler sizes its memo by the index
            raise UnsafePickleError(
                f"the pickle stores memo entry {arg} after {next_memo} entries (an unpickler "
                "would allocate memory for all of them); refusing it"
            )
        name = op.name
        if name in ("GLOBAL", "INST"):
            module, _, qual = str(arg).partition(" ")
            out.append(f"{module}.{qual}")
        elif name == "STACK_GLOBAL":
            if len(recent) < 2 or not all(isinstance(x, str) for x in recent[-2:]):
                raise UnsafePickleError(
                    "the pickle names a global through computed values (STACK_GLOBAL without two "
                    "literal strings); refusing it"
                )
            out.append(f"{recent[-2]}.{recent[-1]}")
        elif name in _REFUSED_OPS:
            raise UnsafePickleError(
                f"the pickle uses the extension registry ({name} {arg}); refusing it"
            )
        if name in _STRING_OPS:
            recent.append(arg if isinstance(arg, str) else bytes(arg or b"").decode("latin1"))
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            recent.append(memo.get(int(arg or 0)))
        elif name == "MEMOIZE":
            memo[next_memo] = recent[-1] if recent else None
            next_memo += 1
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[int(arg or 0)] = recent[-1] if recent else None
            next_memo += 1
        elif name not in ("FRAME", "PROTO"):
            recent.append(None)
        if len(recent) > 8:
            del recent[:-4]
    return out


def scan_pickle(data: bytes, where: str) -> list[str]:
    """`pickle_globals(data)`, its refusals and a garbled pickle's errors named for `where`."""
    try:
        return pickle_globals(data)
    except UnsafePickleError as e:
        raise UnsafePickleError(
            f"{where}: {e}; ucp_jax never runs code from checkpoint files"
        ) from None
    except Exception as e:  # a truncated or garbled pickle
        raise UnsafePickleError(f"{where}: not a readable pickle ({e})") from e


def check_pickle(data: bytes, where: str) -> None:
    """Refuse a pickle that names any global outside the allow-list, naming the global."""
    for n in scan_pickle(data, where):
        if not allowed(n):
            raise UnsafePickleError(
                f"{where}: refusing to load: the pickle asks for the global {n!r}, which is not on "
                "ucp_jax's allow-list (tensors, containers, and data stand-ins for DeepSpeed's loss "
                "scaler, fragment address and ZeRO stage, and Megatron's enums); nothing of the "
                "file was run. Only load "
                "checkpoints you trust with torch.load(weights_only=False) yourself"
            )


# ------------------------------------------------------------------------- gate 2: torch.load

_lock = threading.Lock()
_active = 0


def _safe_list() -> list[Any]:
    out = [(obj, name) for name, obj in STAND_INS.items()]
    out += [(obj, name) for name, obj in numpy_globals().items()]
    return out


@contextlib.contextmanager
def _stand_ins_registered() -> Iterator[None]:
    """Register the stand-ins with torch while any of our loads runs (thread-safe, nested)."""
    global _active
    import torch

    with _lock:
        if _active == 0:
            torch.serialization.add_safe_globals(_safe_list())
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                torch.serialization._weights_only_unpickler._remove_safe_globals(_safe_list())


def zip_member(z: zipfile.ZipFile, name: str, where: str) -> bytes:
    """A zip member's bytes, refused before it is inflated when it claims (or inflates to) more
    than MAX_PICKLE_BYTES: a few MB of deflated zeros inflate to gigabytes."""
    size = z.getinfo(name).file_size
    if size > MAX_PICKLE_BYTES:
        raise UnsafePickleError(
            f"{where}: its {name} holds {size} bytes once inflated, more than a pickle of "
            f"tensor metadata may ({MAX_PICKLE_BYTES}); damaged or not a torch checkpoint"
        )
    with z.open(name) as f:
        data = f.read(MAX_PICKLE_BYTES + 1)
    if len(data) > MAX_PICKLE_BYTES:
        raise UnsafePickleError(f"{where}: its {name} inflates beyond {MAX_PICKLE_BYTES} bytes")
    return data


def _zip_pickle(path: str) -> bytes | None:
    """The main pickle of a zip-format torch file, or None for the legacy format."""
    if not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(names) != 1:
            raise UnsafePickleError(
                f"{path}: a zip file without exactly one data.pkl ({names[:3]})"
            )
        return zip_member(z, names[0], path)


def load(path: str | os.PathLike[str], *, mmap: bool = True) -> Any:
    """Load a torch file weights-only: tensors come back as CPU tensors (memory-mapped when `mmap`).

    Raises:
        UnsafePickleError: the file names a global outside the allow-list (nothing was run).
        FileNotFoundError: no such file.
    """
    import torch

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    data = _zip_pickle(path)
    if data is not None:
        check_pickle(data, path)
    try:
        with _stand_ins_registered():
            out = torch.load(
                path, map_location="cpu", weights_only=True, mmap=bool(mmap and data is not None)
            )
    except pickle.UnpicklingError as e:
        raise UnsafePickleError(
            f"{path}: refused by torch's weights-only unpickler ({str(e).splitlines()[0]}); "
            "ucp_jax never runs code from checkpoint files"
        ) from None
    return _checked_tensors(out, path)


def _checked_tensors(out: Any, where: str) -> Any:
    """`out`, after checking that no tensor in it repeats its storage's elements (an expanded
    view) into more than `limits.MAX_EXPANDED_BYTES` beyond them: reading one copies them all.

    Raises:
        LimitError: one does.
    """
    import torch

    todo, seen = [out], set()  # (a pickle may hold a list inside itself)
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if x.layout == torch.strided and x.numel():
                size = x.element_size()
                items = x.untyped_storage().nbytes() // size
                check_expanded(where, tuple(x.shape), x.stride(), items, size)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, list | tuple):
            todo.extend(x)
    return out


def loads(data: bytes, where: str = "<bytes>") -> Any:
    """Like `load`, from the bytes of a torch file (tests, small files)."""
    import torch

    buf = io.BytesIO(data)
    if zipfile.is_zipfile(buf):
        with zipfile.ZipFile(buf) as z:
            names = [n for n in z.namelist() if n.endswith("data.pkl")]
            if len(names) != 1:
                raise UnsafePickleError(f"{where}: a zip file without exactly one data.pkl")
            check_pickle(zip_member(z, names[0], where), where)
    buf.seek(0)
    try:
        with _stand_ins_registered():
            out = torch.load(buf, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafePickleError(
            f"{where}: refused by torch's weights-only unpickler ({str(e).splitlines()[0]})"
        ) from None
    return _checked_tensors(out, where)


# --------------------------------------------------------------- plain pickles (DCP metadata)


class RestrictedUnpickler(pickle.Unpickler):
    """A `pickle.Unpickler` that resolves only the globals of `allowed` (name -> object).

    `find_class` is the one way a pickle reaches code; with an allow-list of data classes, loading
    builds data and runs nothing else. Anything else raises UnsafePickleError naming the global.
    """

    def __init__(self, file: Any, allowed: dict[str, Any], where: str) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in self._allowed:
            return self._allowed[full]
        raise UnsafePickleError(
            f"{self._where}: refusing to load: the pickle asks for the global {full!r}, which is "
            "not on ucp_jax's allow-list; nothing of the file was run"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(
            f"{self._where}: unexpected persistent id {pid!r} in a plain pickle"
        )


def torch_value_globals() -> dict[str, Any]:
    """torch.Size, dtypes, layouts and memory formats by their pickled names."""
    import torch

    out: dict[str, Any] = {
        "torch.Size": torch.Size,
        "collections.OrderedDict": __import__("collections").OrderedDict,
    }
    for attr in dir(torch):
        v = getattr(torch, attr, None)
        if isinstance(v, torch.dtype | torch.layout | torch.memory_format):
            out[f"torch.{attr}"] = v
    return out


def load_pickle(path: str | os.PathLike[str], allowed: dict[str, Any]) -> Any:
    """Load a plain pickle file resolving only `allowed` globals (see RestrictedUnpickler)."""
    path = os.fspath(path)
    try:
        f = open_regular(path, "the pickle")
    except UnsafePathError as e:
        raise UnsafePickleError(str(e)) from e
    with f:
        data = f.read(MAX_PICKLE_BYTES + 1)
    if len(data) > MAX_PICKLE_BYTES:
        raise UnsafePickleError(f"{path}: more than {MAX_PICKLE_BYTES} bytes of pickle")
    scan_pickle(data, path)  # memo indices bounded before C's unpickler sizes its memo by them
    with io.BytesIO(data) as f:
        try:
            return RestrictedUnpickler(f, allowed, path).load()
        except UnsafePickleError:
            raise
        except Exception as e:
            raise UnsafePickleError(f"{path}: not a readable pickle ({e})") from e


__all__ = [
    "RestrictedUnpickler",
    "UnsafePickleError",
    "allowed",
    "check_pickle",
    "load",
    "load_pickle",
    "loads",
    "pickle_globals",
]
