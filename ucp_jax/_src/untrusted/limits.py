"""Checks on sizes read from untrusted PyTorch files, made before anything is allocated or read.

Importers read shapes, element counts, offsets and lengths out of files from elsewhere. Each is
checked here against what it may be (a non-negative integer, a range inside the tensor or file
that backs it, at most `MAX_ELEMENTS`) so that a damaged or hostile file ends in a `UcpError`
naming the file, the tensor, what was expected and what was found, never in a huge allocation,
a read of the wrong bytes, or a raw `KeyError`/`TypeError` from deep inside.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import struct
import zipfile
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..errors import LimitError, UcpError, UnsafePickleError
from .json import MAX_JSON_DEPTH as MAX_JSON_DEPTH

# The limits of every untrusted input, manifests included (format.validate uses them too).
MAX_NDIM = 32
MAX_ELEMENTS = 1 << 48  # per stored array (256 Ti elements)
MAX_CHUNK_FILES = 1 << 22  # per stored array
MAX_MANIFEST_BYTES = 1 << 30
# what a tensor of a torch file may add over its storage by repeating elements (an expanded
# view, stride 0: 1.5 KB of file can claim 16 GiB); reading it copies every repeat
MAX_EXPANDED_BYTES = 64 << 20

F = TypeVar("F", bound=Callable[..., Any])


def as_int(value: object, what: str, error: type[UcpError]) -> int:
    """A non-negative integer from untrusted input (bools and floats refused)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise error(f"{what}: expected a non-negative integer, found {value!r}") from None
    if n < 0:
        raise error(f"{what}: expected a non-negative integer, found {n}")
    return n


def as_shape(value: object, what: str, error: type[UcpError]) -> tuple[int, ...]:
    """A shape from untrusted input: a list/tuple of non-negative ints, at most MAX_ELEMENTS."""
    if not isinstance(value, list | tuple) or len(value) > 64:
        raise error(f"{what}: expected a shape (a list of up to 64 integers), found {value!r:.80}")
    shape = tuple(as_int(d, f"{what}: shape {list(value)!r:.80}", error) for d in value)
    numel(shape, what)
    return shape


def numel(shape: Sequence[int], what: str, *, itemsize: int = 0, backing: int = -1,
          backed_by: str = "") -> int:  # fmt: skip
    """Elements of `shape` (Python ints: no overflow); LimitError above MAX_ELEMENTS, or when
    `itemsize` bytes each would not fit in the `backing` bytes of `backed_by`."""
    n = math.prod(int(d) for d in shape)
    if n > MAX_ELEMENTS:
        raise LimitError(
            f"{what}: shape {list(shape)} has {n} elements, more than the limit of {MAX_ELEMENTS}; "
            "the file is damaged or not what it claims"
        )
    if backing >= 0 and n * itemsize > backing:
        raise LimitError(
            f"{what}: shape {list(shape)} needs {n * itemsize} bytes but {backed_by} holds only "
            f"{backing}; the file is damaged or truncated"
        )
    return n


def check_range(start: object, length: object, total: int, what: str,
                error: type[UcpError]) -> tuple[int, int]:  # fmt: skip
    """(start, length) as ints with 0 <= start <= start + length <= total, or `error`."""
    s = as_int(start, f"{what}: start", error)
    n = as_int(length, f"{what}: length", error)
    if s + n > total:
        raise error(
            f"{what}: the range [{s}, {s + n}) lies past the end of what holds it ({total}); "
            "the file is damaged or was edited"
        )
    return s, n


def check_disjoint(ranges: Sequence[tuple[str, object, object]], what: str,
                   error: type[UcpError]) -> None:  # fmt: skip
    """(name, start, length) ranges do not overlap: no two names read the same elements."""
    spans = sorted((as_int(s, f"{what}[{n!r}]: start", error),
                    as_int(k, f"{what}[{n!r}]: length", error), n) for n, s, k in ranges)  # fmt: skip
    for (s0, k0, n0), (s1, _, n1) in itertools.pairwise(spans):
        if s0 + k0 > s1:
            raise error(
                f"{what}: {n0!r} [{s0}, {s0 + k0}) overlaps {n1!r} from {s1}; each element "
                "belongs to one parameter: the file is damaged or was edited"
            )


def check_extent(path: str, at: int, items: int, offset: Any, size: Any, stride: Any,
                 itemsize: int = 1) -> None:  # fmt: skip
    """A tensor of a torch file (storage offset, size, stride in elements) addresses only
    elements of its storage (`items` elements of `itemsize` bytes at byte `at`), and repeats
    them (stride 0) into at most MAX_EXPANDED_BYTES more: checked before any read."""
    ints = [offset, *size, *stride]
    if len(size) != len(stride) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ints
    ):
        raise UnsafePickleError(
            f"{path}: a tensor with storage offset {offset!r}, size {size!r:.60} and stride "
            f"{stride!r:.60}: expected non-negative integers, one stride per dimension"
        )
    if math.prod(size) and offset + sum((d - 1) * s for d, s in zip(size, stride)) >= items:
        raise LimitError(
            f"{path}: a tensor of shape {list(size)} (stride {list(stride)}, storage offset "
            f"{offset}) reaches past its storage of {items} elements at byte {at}; the file is "
            "damaged or was edited"
        )
    check_expanded(path, size, stride, items, itemsize)


def check_expanded(path: str, size: Sequence[int], stride: Sequence[int], items: int,
                   itemsize: int) -> None:  # fmt: skip
    """A tensor of `size` over a storage of `items` elements repeats them (an expanded view,
    stride 0) into at most MAX_EXPANDED_BYTES more than the storage holds; LimitError if not.

    >>> check_expanded("f.pt", [1, 4096], [0, 1], 4096, 4)  # a broadcast row: as stored
    >>> check_expanded("f.pt", [65536, 65536], [0, 0], 1, 4)
    Traceback (most recent call last):
    ...
    ucp_jax._src.errors.LimitError: f.pt: a tensor of shape [65536, 65536] (stride [0, 0]) repeats the 1 element(s) of its storage into 17179869184 bytes, 17179869180 more than the file holds for it (the limit is 67108864); the file is damaged or hostile (save a view you made with expand() as x.contiguous())
    """
    n = math.prod(int(d) for d in size)
    extra = (n - items) * itemsize
    if extra > MAX_EXPANDED_BYTES:
        raise LimitError(
            f"{path}: a tensor of shape {list(size)} (stride {list(stride)}) repeats the "
            f"{items} element(s) of its storage into {n * itemsize} bytes, {extra} more than the "
            f"file holds for it (the limit is {MAX_EXPANDED_BYTES}); the file is damaged or "
            "hostile (save a view you made with expand() as x.contiguous())"
        )


# Errors that a damaged or hostile file makes deep inside an importer (a missing key, a list where
# a dict belongs, a bad reshape, a truncated zip, a nesting too deep for recursion).
RAW_ERRORS = (KeyError, TypeError, AttributeError, IndexError, ValueError, ArithmeticError,
              RuntimeError, EOFError, struct.error, zipfile.BadZipFile)  # fmt: skip


def ucp_errors(error: type[UcpError], what: str) -> Callable[[F], F]:
    """Decorate an importer `fn(src, dst, ...)`: raw errors from bad input become `error`,
    naming `src`; UcpErrors and OS errors pass unchanged."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(src: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(src, *args, **kwargs)
            except UcpError:
                raise
            except RAW_ERRORS as e:
                raise error(
                    f"{src}: {what} failed on unexpected content ({type(e).__name__}: "
                    f"{str(e)[:200]}); the source is damaged or not in the layout this importer "
                    "reads"
                ) from e

        return wrapper  # type: ignore[return-value]

    return deco
