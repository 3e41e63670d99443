"""How much host memory this process can still allocate: the tightest of its address-space limit
(RLIMIT_AS), its cgroup's memory limit and the machine's available memory.

Readers check a restore's needs against it before reading anything (`restore.py`): past these
limits a TensorStore read buffer that cannot be allocated ends the process (a fatal error in
C++, or the kernel's OOM killer), not a Python exception.
"""

from __future__ import annotations

import resource


def _status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            raw = f.read().strip()
    except OSError:
        return None
    return int(raw) if raw.isdecimal() else None


def _cgroup() -> int | None:
    """Bytes left under this process's cgroup memory limit (v2 or v1), None when unlimited."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base = f"/sys/fs/cgroup{path}"
            limit, used = _read_int(f"{base}/memory.max"), _read_int(f"{base}/memory.current")
        elif "memory" in controllers.split(","):  # v1
            base = f"/sys/fs/cgroup/memory{path}"
            limit = _read_int(f"{base}/memory.limit_in_bytes")
            used = _read_int(f"{base}/memory.usage_in_bytes")
        else:
            continue
        if limit is not None and used is not None and limit < (1 << 60):
            return max(limit - used, 0)
    return None


def _available() -> int | None:
    """MemAvailable + SwapFree from /proc/meminfo (what the kernel can give without killing)."""
    try:
        with open("/proc/meminfo") as f:
            info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.count(" ") > 0}
    except (OSError, ValueError, IndexError):
        return None
    if "MemAvailable" not in info:
        return None
    return info["MemAvailable"] + info.get("SwapFree", 0)


def allocatable() -> tuple[int, str] | None:
    """(bytes this process can still allocate, the limit that says so), or None if unknown.

    >>> allocatable() is None or allocatable()[0] >= 0
    True
    """
    found: list[tuple[int, str]] = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    size = _status("VmSize")
    if soft != resource.RLIM_INFINITY and size is not None:
        found.append(
            (max(soft - size, 0), f"its address-space limit (RLIMIT_AS, {soft >> 20} MiB)")
        )
    left = _cgroup()
    if left is not None:
        found.append((left, "its cgroup's memory limit"))
    avail = _available()
    if avail is not None:
        found.append((avail, "the memory available on this machine"))
    return min(found) if found else None


__all__ = ["allocatable"]
