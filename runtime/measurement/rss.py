"""This process's resident memory, read from Linux's /proc: the current size, the high-water mark, and a reset of
the mark (`clear_refs` 5), so that the peak of one stretch of work is read on its own, without what came before."""
from __future__ import annotations

from pathlib import Path

_STATUS = Path("/proc/self/status")


def available() -> bool:
    return _STATUS.is_file()


def _status_bytes(field: str, status: Path = _STATUS) -> int:
    for line in status.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024   # "VmRSS:   123456 kB"
    raise RuntimeError(f"{status} has no {field} line")


def rss_bytes(settled: bool = False) -> int:
    """The resident size; `settled`: after a garbage collection and glibc's malloc_trim, so that memory already
    freed (say, by compiling modules imported for the first time) but still held by the allocator is not counted."""
    if settled:
        settle()
    return _status_bytes("VmRSS")


def process_rss_bytes(pid: int) -> int:
    """Another process's resident size (a server's, say)."""
    return _status_bytes("VmRSS", Path(f"/proc/{pid}/status"))


def settle() -> None:
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass


def peak_rss_bytes() -> int:
    """The high-water mark of the resident set since the process started or since the last `reset_peak()`."""
    return _status_bytes("VmHWM")


def reset_peak() -> None:
    """Set the high-water mark to the current resident size (Linux 4.0 and later)."""
    Path("/proc/self/clear_refs").write_text("5")
