"""One writer per checkpoint path: two saves of the same path at once never mix.

Two jobs misconfigured to save the same step to the same folder (or a job restarted while its
previous incarnation still writes) would otherwise clear and fill one staging area together.

* Local files: process 0 of a save holds an exclusive `flock` on `<parent>/.<name>.ucp-lock` from
  `prepare` to the end of `commit` (or its failure). A second save that finds it held fails at
  once with a `WriterConflictError` naming the holder, having written nothing; the lock goes
  with its holder's process, so a killed save leaves none behind.
  Staging folders that killed saves left (their lock free) are removed by the next save into
  the same folder (`sweep`).
* Object stores (no locks): process 0 claims the path before it clears anything, by writing
  `<parent>/.<name>.ucp-writer` on the condition that it is absent (a conditional write: S3 If-None-Match, GCS
  generations), renews the claim (conditionally on its own last generation) every quarter of
  `UCP_WRITER_CLAIM_S` and before each transaction and COMMIT, and deletes it after COMMIT. A
  second save finds the claim and, while it is renewed, fails with a `WriterConflictError`
  having changed nothing; a claim that stays unchanged for `UCP_WRITER_CLAIM_S` was left by a
  killed save and is taken over.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from typing import IO, Any

from ..errors import StoreError, WriterConflictError
from ..util import config
from . import remote
from .store import Location

log = logging.getLogger("ucp_jax")
TOKEN_SUFFIX = ".ucp-writer"


class PathLock:
    """The exclusive lock of one local checkpoint path (see the module docstring)."""

    def __init__(self, final: str) -> None:
        self.path = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.ucp-lock")
        self.final = final
        self._f: IO[bytes] | None = None

    def acquire(self, wait_s: float = 0.0) -> None:
        """Take the lock, or raise WriterConflictError naming who holds it.

        Args:
            wait_s: how long to keep trying while it is held (a folder's `sweep` holds other
                paths' locks for a moment; a save holds its own until it commits).
        """
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self._try_acquire()
            except WriterConflictError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    def _try_acquire(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        for _ in range(8):  # a holder that unlinks the file as we open it: try the new one
            f = open(self.path, "a+b")  # noqa: SIM115 - held until release()
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read(200).decode(errors="replace").strip() or "another process"
                f.close()
                raise WriterConflictError(
                    f"{self.final}: another save to this checkpoint is in progress ({holder} "
                    f"holds {self.path}); two jobs are saving the same step to the same folder: "
                    "give each its own folder (or step). This save wrote nothing"
                ) from None
            try:
                same = os.fstat(f.fileno()).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                f.truncate(0)
                f.write(f"pid {os.getpid()} on {socket.gethostname()}".encode())
                f.flush()
                self._f = f
                return
            f.close()
        raise WriterConflictError(f"{self.final}: could not take {self.path}; try again")

    def release(self) -> None:
        """Drop the lock (and its file); a no-op when not held."""
        f, self._f = self._f, None
        if f is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            f.close()

    @property
    def held(self) -> bool:
        return self._f is not None


class Token:
    """A save's claim on one object-store path: the `.ucp-writer` object (module docstring).

    Taken and renewed with conditional writes (on the generation last seen), so two saves never
    both hold it; renewed by a background thread every quarter of `UCP_WRITER_CLAIM_S`, so a
    claim left by a killed save is taken over once it has not changed for that long.
    """

    def __init__(self, final: Location, *, for_delete: bool = False) -> None:
        # Beside the checkpoint, not in it (clearing the checkpoint's path keeps the claim):
        # `<parent>/.<name>.ucp-writer`; listings of checkpoints skip it (no '/COMMIT').
        spec = dict(final.kvstore)
        path = spec["path"].rstrip("/")
        spec["path"] = path.rsplit("/", 1)[0] + "/" if "/" in path else ""
        self.loc = Location(spec, final.context)
        self.key = f".{final.name}{TOKEN_SUFFIX}"
        self.url, self.final = final.url, final  # errors name the checkpoint
        self.who = f"pid {os.getpid()} on {socket.gethostname()}"
        self._gen: bytes | None = None
        self._lost = False
        self._unconditional = False  # the store refused conditional writes (see _put)
        self.for_delete = for_delete
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _wait(self, future: Any, what: str) -> Any:
        return remote.wait(future, self.final.kvstore, what) if self.loc.remote else future.result()

    def _read(self) -> Any:
        return self._wait(self.loc.kv().read(self.key), f"a read of {self.key}")

    def _put(self, value: bytes | None, if_equal: bytes) -> bytes:
        """A conditional write (None: delete); the new generation, b'' when the condition failed.

        A store that answers conditional writes with "not implemented" (HTTP 501: AWS S3 before
        2024, some S3-compatible stores) cannot hold a save, since TensorStore creates every
        array with a conditional write: a StoreError says so before anything is written. A
        deletion (``for_delete``) goes on unconditionally, with a warning.
        """
        kv = self.loc.kv()
        what = f"a write of {self.key}"
        if not self._unconditional:
            try:
                return bytes(
                    self._wait(kv.write(self.key, value, if_equal=if_equal), what).generation
                )
            except (NotImplementedError, ValueError) as e:
                if not _not_implemented(e):
                    raise
                if not self.for_delete:
                    raise StoreError(
                        f"{self.url}: the store does not implement conditional writes ("
                        f"{str(e)[:120]}); TensorStore writes every array with them, so no "
                        "checkpoint can be saved there: use a store that has them (AWS S3 since "
                        "2024, GCS, MinIO, R2), or save to a local path and copy it"
                    ) from e
                self._unconditional = True
                log.warning(
                    "%s: the store does not implement conditional writes (%s); the deletion's "
                    "claim %s is written unconditionally", self.url, str(e)[:120], self.key,
                )  # fmt: skip
        g = self._wait(kv.write(self.key, value), what)
        return bytes(g.generation) or b"unconditional"

    def _body(self) -> bytes:
        return f"{uuid.uuid4().hex} {self.who}".encode()

    def _conflict(self, holder: bytes, when: str) -> WriterConflictError:
        return WriterConflictError(
            f"{self.url}: another save to this checkpoint {when} ({self.key}: "
            f"{holder.decode(errors='replace')[:120]!r}); two jobs are saving the same step to "
            "the same path: give each its own path (or step). This save wrote no COMMIT"
        )

    def claim(self) -> None:
        """Take the path, or raise WriterConflictError (having changed nothing)."""
        r = self._read()
        gen = bytes(r.stamp.generation)
        if r.state == "value":  # held: by a live save (it renews) or a dead one (it does not)
            period = config.writer_claim_s()
            deadline = time.monotonic() + period
            log.warning(
                "%s: another save's claim is on this path (%s: %r); waiting up to %.0f s "
                "(UCP_WRITER_CLAIM_S) to see whether that save is alive (it renews its claim) "
                "or was killed (its claim is then taken over)", self.url, self.key,
                bytes(r.value).decode(errors="replace")[:80], period,
            )  # fmt: skip
            while time.monotonic() < deadline:
                time.sleep(min(period / 8, 1.0))
                now = self._read()
                if now.state != "value" or bytes(now.stamp.generation) != gen:
                    if now.state == "value":
                        raise self._conflict(bytes(now.value), "is in progress")
                    gen = bytes(now.stamp.generation)  # it finished: the path is free
                    break
        body = self._body()
        g = self._put(body, gen)
        if not g:
            now = self._read()
            if now.state == "value" and bytes(now.value) == body:  # ours: an answer got lost
                g = bytes(now.stamp.generation)
            elif now.state == "value":
                raise self._conflict(bytes(now.value), "claimed the path at the same moment")
            else:  # a store without conditional writes: unconditionally (or its own error)
                g = bytes(self._wait(self.loc.kv().write(self.key, body), "a write").generation)
        self._gen = g
        self._thread = threading.Thread(target=self._renew_loop, name="ucp-writer", daemon=True)
        self._thread.start()

    def renew(self) -> None:
        """Renew the claim now; raise WriterConflictError if another save holds it."""
        with self._lock:
            if self._gen is None:
                return
            if not self._lost:
                body = self._body()
                g = self._put(body, self._gen)
                if not g:  # lost, unless the write landed and only its answer did not
                    now = self._read()
                    ours = now.state == "value" and bytes(now.value) == body
                    g = bytes(now.stamp.generation) if ours else b""
                self._lost = not g
                self._gen = g or self._gen
            if self._lost:
                raise self._conflict(
                    bytes(self._read().value), "took the path while this one wrote"
                )

    def _renew_loop(self) -> None:
        while not self._stop.wait(config.writer_claim_s() / 4):
            with contextlib.suppress(Exception):  # a failed renewal shows at the next check
                self.renew()

    def drop(self) -> None:
        """Give the path back (after COMMIT, or a failure); idempotent, best effort."""
        self._stop.set()
        with self._lock:
            gen, self._gen = self._gen, None
        if gen is not None and not self._lost:
            with contextlib.suppress(Exception):
                self._put(None, gen)


def _not_implemented(e: BaseException) -> bool:
    """Whether a store's error says a conditional write is not implemented (HTTP 501)."""
    text = str(e)
    return (
        isinstance(e, NotImplementedError)
        or "http_response_code='501'" in text
        or ("NotImplemented" in text)
    )


def sweep(parent: str, keep: str) -> None:
    """Remove what killed saves left in `parent` (their `.<name>.ucp-tmp` staging folders,
    `.<name>.ucp-old-*` trash and `.<name>.ucp-lock` files), for every path whose lock nobody
    holds: a save in progress (its lock held) is left alone. `keep`: the caller's own name."""
    names = set()
    for n in sorted(_listdir(parent)):
        parts = n[1:].rsplit(".ucp-", 1) if n.startswith(".") else []
        if len(parts) == 2 and parts[0]:  # `.<name>.ucp-<kind>`; other dot-files are not ours
            name, kind = parts
            if kind in ("tmp", "lock") or kind.startswith("old-"):
                names.add(name)
    for name in sorted(names - {keep}):
        lock = PathLock(os.path.join(parent, name))
        try:
            lock.acquire()
        except WriterConflictError:
            continue  # a save in progress
        try:
            for n in _listdir(parent):
                if n == f".{name}.ucp-tmp" or n.startswith(f".{name}.ucp-old-"):
                    shutil.rmtree(os.path.join(parent, n), ignore_errors=True)
        finally:
            lock.release()


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
