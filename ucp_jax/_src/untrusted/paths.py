"""Names from checkpoints and source folders, turned into paths that cannot leave their folder.

Every reader and writer that makes a file path out of a name it did not choose (an atom, a slot, a
tensor name in a DeepSpeed or safetensors file, a `relative_path` in a DCP `.metadata`, a file in a
safetensors index) goes through here:

* `check_component(name)`: one path component: no separators, not `.`/`..`, no NUL, not empty.
* `join_inside(root, rel)`: a relative path below `root` (components checked one by one).
* `refuse_symlinks(root, rel)` / `open_inside(root, rel)`: no component below `root` is a
  symbolic link (the root itself may be one: `/ckpt/latest -> step_100` is the user's choice).
* `check_tree(root)`: nothing anywhere below `root` is a symbolic link.

They raise `UnsafePathError` naming the name, the folder and what to do.
"""

from __future__ import annotations

import os
import stat
import urllib.parse
from collections.abc import Callable, Sequence
from typing import IO

from ..errors import UnsafePathError

MAX_COMPONENT_BYTES = 255  # NAME_MAX on Linux and macOS


def check_component(name: object, what: str) -> str:
    """`name` as one path component, or UnsafePathError.

    Args:
        name: the name (an atom, a slot, a tensor name...).
        what: what it names, for the message ("atom", "tensor name in x.pt", ...).

    Returns:
        `name`, unchanged.

    Raises:
        UnsafePathError: it is not a str, empty, `.` or `..`, holds `/`, `\\` or NUL, or is too long.

    >>> check_component("fp32", "slot")
    'fp32'
    >>> check_component("../x", "slot")
    Traceback (most recent call last):
    ...
    ucp_jax._src.errors.UnsafePathError: slot '../x': a path component must not hold '/' or '\\\\'; rename it
    """
    if not isinstance(name, str):
        raise UnsafePathError(f"{what} {name!r}: expected a string, found {type(name).__name__}")
    if name in ("", ".", ".."):
        raise UnsafePathError(
            f"{what} {name!r}: not a usable file name (empty, '.' or '..'); rename it"
        )
    if "/" in name or "\\" in name:
        raise UnsafePathError(
            f"{what} {name!r}: a path component must not hold '/' or '\\\\'; rename it"
        )
    if "\x00" in name:
        raise UnsafePathError(f"{what} {name!r}: holds a NUL byte; rename it")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_COMPONENT_BYTES:
        raise UnsafePathError(
            f"{what} {name[:40]!r}...: longer than {MAX_COMPONENT_BYTES} bytes; rename it"
        )
    return name


def split_relative(rel: object, what: str) -> list[str]:
    """The components of a relative path with '/' separators, each checked.

    Raises:
        UnsafePathError: absolute, empty, or a component that `check_component` refuses.
    """
    if not isinstance(rel, str) or not rel:
        raise UnsafePathError(f"{what} {rel!r}: expected a non-empty relative path")
    if rel.startswith(("/", "\\")) or (len(rel) > 1 and rel[1] == ":"):
        raise UnsafePathError(f"{what} {rel!r}: an absolute path; only paths inside the folder")
    return [check_component(c, f"{what} {rel!r}: component") for c in rel.split("/")]


def join_inside(root: str, rel: str, what: str) -> str:
    """`root/rel`, refusing any `rel` that could name something outside `root`.

    >>> join_inside("/src", "model-00001.safetensors", "file")
    '/src/model-00001.safetensors'
    """
    return os.path.join(root, *split_relative(rel, what))


def refuse_symlinks(root: str, rel: str, what: str) -> str:
    """`join_inside(root, rel)`, after checking no component below `root` is a symbolic link.

    Components that do not exist are not checked (opening them fails on its own).
    """
    path = root
    for c in split_relative(rel, what):
        path = os.path.join(path, c)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            break
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePathError(
                f"{path}: {what} is a symbolic link ({os.readlink(path)!r}); links inside a "
                "checkpoint or source folder are refused: copy the real files in"
            )
    return os.path.join(root, *split_relative(rel, what))


_READ_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
               | getattr(os, "O_NONBLOCK", 0))  # fmt: skip


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def _check_size(path: str, size: int, bound: int | None, where: str = "") -> None:
    """UnsafePathError when a file of `size` bytes is over `bound` (None: no bound)."""
    if bound is not None and size > bound:
        raise UnsafePathError(
            f"{path}: {size} bytes{where}, more than such a file may hold ({bound}); the "
            "checkpoint is damaged or not one ucp_jax wrote"
        )


def regular_fd(fd: int, path: str, what: str, max_bytes: int | None = None) -> int:
    """`fd` (opened with `_READ_FLAGS`) back in blocking mode once it is a regular file of at
    most `max_bytes`; closed and UnsafePathError otherwise (reading a FIFO would wait forever,
    a device never end)."""
    st = os.fstat(fd)
    try:
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(
                f"{path}: {what} is {_kind(st.st_mode)}, not a regular file; a checkpoint or "
                "source folder holds files and folders only"
            )
        _check_size(path, st.st_size, max_bytes)
    except UnsafePathError:
        os.close(fd)
        raise
    os.set_blocking(fd, True)
    return fd


def open_regular(path: str, what: str, *, dir_fd: int | None = None) -> IO[bytes]:
    """Open a regular file for binary reading, without following a symbolic link and without
    blocking on a FIFO (refused, as any other special file, with UnsafePathError)."""
    return os.fdopen(regular_fd(os.open(path, _READ_FLAGS, dir_fd=dir_fd), path, what), "rb")


def open_inside(root: str, rel: str, what: str) -> IO[bytes]:
    """Open `root/rel` for binary reading: inside `root`, and no symbolic link on the way.

    Raises:
        UnsafePathError: see `refuse_symlinks`; or not a regular file (a FIFO, a device...).
        OSError: the file cannot be opened.
    """
    return open_regular(refuse_symlinks(root, rel, what), what)


def check_tree(root: str, what: str, max_bytes: Callable[[str], int | None] | None = None) -> None:
    """Refuse a folder with a symbolic link or a special file (a FIFO, a socket, a device: the
    storage library would wait on it forever) anywhere below it, or a file larger than
    `max_bytes(its name)` (metadata the storage library reads whole, before any check).

    One `scandir` per folder; the entry types come with the listing (an `lstat` only for the
    files `max_bytes` bounds).
    """
    todo = [root]
    while todo:
        with os.scandir(todo.pop()) as entries:
            for e in entries:
                if e.is_symlink():
                    raise UnsafePathError(
                        f"{e.path}: a symbolic link inside {what} {root} "
                        f"({os.readlink(e.path)!r}); links are refused: copy the real files in"
                    )
                if e.is_dir(follow_symlinks=False):
                    todo.append(e.path)
                elif not e.is_file(follow_symlinks=False):
                    mode = e.stat(follow_symlinks=False).st_mode
                    raise UnsafePathError(
                        f"{e.path}: {_kind(mode)} inside {what} {root}; a checkpoint holds "
                        "files and folders only"
                    )
                elif max_bytes is not None and (bound := max_bytes(e.name)) is not None:
                    size = e.stat(follow_symlinks=False).st_size
                    _check_size(e.path, size, bound, f" inside {what} {root}")


def atom_dir(atom: str) -> str:
    """Relative directory of an atom: `atoms/<atom>`, with unsafe characters percent-encoded.

    Raises:
        UnsafePathError: a name that cannot be a folder (empty, `.`, `..`, too long once quoted).

    >>> atom_dir("blocks.0/qkv")
    'atoms/blocks.0%2Fqkv'
    """
    quoted = urllib.parse.quote(atom, safe=".-_")
    return "atoms/" + check_component(quoted, "atom name, used as atom folder")


def read_together(
    folder: str, names: Sequence[str], max_bytes: int | None = None
) -> list[bytes | None]:
    """The files `names` of one folder, read through one handle on it (None: missing).

    All come from the same folder even when its path is swapped for another meanwhile (an
    overwrite that publishes a checkpoint atomically): never one file of the old and one of the
    new. A name that is a symbolic link reads as missing (callers refuse links first). A FIFO
    or another special file is refused (UnsafePathError), and so is a file over `max_bytes`
    before it is read.
    """
    try:
        dfd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except FileNotFoundError:
        return [None] * len(names)
    out: list[bytes | None] = []
    try:
        for name in names:
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
            except OSError:
                out.append(None)
                continue
            fd = regular_fd(fd, os.path.join(folder, name), "it", max_bytes)
            with os.fdopen(fd, "rb") as f:
                out.append(f.read())
    finally:
        os.close(dfd)
    return out
