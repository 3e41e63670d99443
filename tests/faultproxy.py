"""A fault-injecting HTTP proxy on loopback, between TensorStore's client and an object-store server.

Each request the client sends is read (request line, headers, a Content-Length or chunked body),
then either forwarded to the upstream server on a fresh connection, its answer passed back
whole, or answered with a fault, chosen by a seeded RNG:

* `reset_upload`: half of the request body is read, then the connection is reset;
* `reset_download`: forwarded, then the answer is cut off after part of its body;
* `http500`, `http503`: an error answer without forwarding;
* `stall`: nothing is sent back for `stall_s` seconds, then the connection is dropped.

`rate` is the chance of a fault per request, at most `max_in_a_row` faults in a row (so that a
client that retries gets through); `down()` makes every request fail (an outage), `up()` ends it.
Every loop is bounded: a connection serves at most `MAX_REQUESTS` requests, every socket has a
timeout, and the server thread stops at `close()`.
"""

from __future__ import annotations

import random
import socket
import socketserver
import threading
import time
from collections import Counter
from typing import Any

MAX_REQUESTS = 10_000  # per client connection
MAX_HEADER = 64 << 10
TIMEOUT_S = 30.0
KINDS = ("reset_upload", "reset_download", "http500", "http503", "stall")


class _Drop(Exception):
    """The client connection goes away (injected, or the client closed it)."""


def _read_until(sock: socket.socket, buf: bytearray, marker: bytes, limit: int) -> int:
    while True:
        i = buf.find(marker)
        if i >= 0:
            return i
        if len(buf) > limit:
            raise _Drop("header too long")
        chunk = sock.recv(65536)
        if not chunk:
            raise _Drop("closed")
        buf += chunk


def _read_exact(sock: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        chunk = sock.recv(min(1 << 20, n - len(buf)) or 1)
        if not chunk:
            raise _Drop("closed")
        buf += chunk
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _read_head(sock: socket.socket, buf: bytearray) -> bytes:
    return _read_exact(sock, buf, _read_until(sock, buf, b"\r\n\r\n", MAX_HEADER) + 4)


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return int(v)
    return 0


def _read_message(sock: socket.socket, buf: bytearray, *, response: bool = False,
                  head_request: bool = False, head: bytes | None = None,
                  ) -> tuple[bytes, bytes]:  # fmt: skip
    """One HTTP message from `sock` (leftover bytes in `buf`; its head if already read)."""
    if head is None:
        head = _read_head(sock, buf)
    fields = {}
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        fields[k.strip().lower()] = v.strip()
    status = int(head.split(b" ", 2)[1]) if response else 0
    if head_request or status in (204, 304) or 100 <= status < 200:
        return head, b""
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        body = bytearray()
        for _ in range(1 << 20):  # bounded: at most this many chunks
            i = _read_until(sock, buf, b"\r\n", MAX_HEADER)
            size = int(_read_exact(sock, buf, i + 2)[:i].split(b";")[0], 16)
            body += _read_exact(sock, buf, size + 2)[:size] if size else b""
            if size == 0:
                _read_until(sock, buf, b"\r\n", MAX_HEADER)  # trailers end with an empty line
                _read_exact(sock, buf, buf.find(b"\r\n") + 2)
                break
        head = head.replace(b"Transfer-Encoding: chunked", b"Content-Length: %d" % len(body))
        return head, bytes(body)
    if b"content-length" in fields:
        return head, _read_exact(sock, buf, int(fields[b"content-length"]))
    if response:  # no length: the body runs to the end of the connection
        while True:
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
        body = bytes(buf)
        buf.clear()
        return head, body
    return head, b""


class FaultProxy:
    """See the module docstring. `counts`: the faults injected, and `forwarded` requests."""

    def __init__(self, upstream: str, *, rate: float = 0.0, kinds: tuple[str, ...] = KINDS,
                 seed: int = 0, max_in_a_row: int = 2, stall_s: float = 5.0,
                 no_conditional: bool = False) -> None:  # fmt: skip
        host, port = upstream.replace("http://", "").rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.rate, self.kinds, self.max_in_a_row, self.stall_s = rate, kinds, max_in_a_row, stall_s
        # a store without conditional writes (AWS S3 before 2024, some S3-compatible stores):
        # a PUT or DELETE with If-Match / If-None-Match is answered 501 NotImplemented
        self.no_conditional = no_conditional
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._in_a_row = 0
        self._down: str | None = None
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.request)

        class Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def down(self, kind: str = "http503") -> None:
        """From now on every request fails with `kind` (an outage)."""
        self._down = kind

    def up(self) -> None:
        self._down = None

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _fault(self) -> str | None:
        with self._lock:
            if self._down is not None:
                self.counts[self._down] += 1
                return self._down
            if self._in_a_row < self.max_in_a_row and self.rng.random() < self.rate:
                self._in_a_row += 1
                kind = self.rng.choice(self.kinds)
                self.counts[kind] += 1
                return kind
            self._in_a_row = 0
            self.counts["forwarded"] += 1
            return None

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(TIMEOUT_S)
        buf = bytearray()
        try:
            for _ in range(MAX_REQUESTS):
                head = _read_head(client, buf)
                fault = self._fault()
                if fault == "reset_upload":  # half of the body comes in, then a reset
                    _read_exact(client, buf, min(_content_length(head) // 2, 1 << 30))
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                      b"\x01\x00\x00\x00\x00\x00\x00\x00")  # fmt: skip
                    return
                _, body = _read_message(client, buf, head=head)
                if not self._one(client, head, body, fault):
                    return
        except (_Drop, OSError, ValueError, IndexError):
            return
        finally:
            client.close()

    def _one(self, client: socket.socket, head: bytes, body: bytes, fault: str | None) -> bool:
        """Serve one request; False when the client connection must close."""
        lower = head.lower()
        if (
            self.no_conditional
            and head.split(b" ", 1)[0] in (b"PUT", b"DELETE")
            and (b"\r\nif-match:" in lower or b"\r\nif-none-match:" in lower)
        ):
            self.counts["not_implemented"] += 1
            text = (b"<Error><Code>NotImplemented</Code><Message>A header you provided implies "
                    b"functionality that is not implemented</Message></Error>")  # fmt: skip
            client.sendall(b"HTTP/1.1 501 Not Implemented\r\nContent-Type: application/xml\r\n"
                           b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                           % (len(text), text))  # fmt: skip
            return False
        if fault in ("http500", "http503"):
            code = 500 if fault == "http500" else 503
            text = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
            reason = b"Internal Server Error" if code == 500 else b"Service Unavailable"
            client.sendall(b"HTTP/1.1 %d %s\r\nContent-Type: application/xml\r\n"
                           b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                           % (code, reason, len(text), text))  # fmt: skip
            return False
        if fault == "stall":
            time.sleep(self.stall_s)
            return False
        up = socket.create_connection(self.upstream, timeout=TIMEOUT_S)
        try:
            lines = head.split(b"\r\n")
            kept = [ln for ln in lines[1:] if not ln.lower().startswith(b"connection:")]
            up.sendall(b"\r\n".join([lines[0], b"Connection: close", *kept]) + body)
            is_head = lines[0].startswith(b"HEAD ")
            rhead, rbody = _read_message(up, bytearray(), response=True, head_request=is_head)
        finally:
            up.close()
        rlines = [ln for ln in rhead.split(b"\r\n") if not ln.lower().startswith(b"connection:")]
        rhead = b"\r\n".join([*rlines[:-2], b"Connection: close", b"", b""])
        if fault == "reset_download" and rbody:
            client.sendall(rhead + rbody[: len(rbody) // 2])
            return False
        client.sendall(rhead + rbody)
        return False  # one request per connection: the client opens a new one
