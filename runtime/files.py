"""Directories written whole or not at all: the staging directory of an engine export and of a datastore build."""
from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from specrt.errors import InputError


@contextlib.contextmanager
def signals_deferred():
    """SIGINT and SIGTERM wait until the block ends (main thread, POSIX; elsewhere a no-op)."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    can = hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs) if can else None
    try:
        yield
    finally:
        if can:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


class StagingDir:
    """Write a directory beside its final place `out` and move it there only when complete, replacing what is at
    `out` (with `force`; the caller checks first that what is there may be replaced). An interrupted or failed
    write leaves nothing at `out` and removes its staging directory.

    It removes only what it made: its staging directory (`.NAME.partial-*`) and the old `out`, moved aside into a
    folder of its own (`.NAME.old-*`). Folders beside `out` with such names that it did not make are left where
    they are and named through `log`: a name does not prove a folder is a leftover (another export to the same
    `out` may be writing it now), and a `.old` one left by a crash between the two renames holds the only copy of
    the directory it was replacing."""

    def __init__(self, out: str | Path, force: bool, log=_stderr):
        self.out, self.force, self.log = Path(out), force, log

    def __enter__(self) -> Path:
        if not self.force and (self.out.exists() or self.out.is_symlink()):
            raise InputError(f"{self.out} already exists; pass --force to replace it (once the new one is complete)")
        # Ctrl-C raises KeyboardInterrupt, but one that lands in a destructor is printed and swallowed; the flag makes
        # sure an interrupted write never moves into place.
        self.interrupted, self.previous = False, None
        if threading.current_thread() is threading.main_thread() and callable(signal.getsignal(signal.SIGINT)):
            self.previous = signal.signal(signal.SIGINT, self._on_sigint)
        parent, name = self.out.parent, self.out.name
        parent.mkdir(parents=True, exist_ok=True)
        found = sorted({p.name for pattern in (f".{name}.partial-*", f".{name}.old", f".{name}.old-*")
                        for p in parent.glob(pattern)})
        if found:
            self.log(f"left {', '.join(found)} in {parent}: named like the staging folders of a write to {name} that "
                     "did not finish (or one still running), but not made by this one, so not removed; remove them "
                     "yourself once no export or build to it is running")
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=parent))
        return self.tmp

    def _on_sigint(self, signum, frame):
        self.interrupted = True
        self.previous(signum, frame)

    def __exit__(self, exc_type, exc, tb):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        if exc_type is None and self.interrupted:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise KeyboardInterrupt
        if exc_type is not None:
            with signals_deferred():  # a second Ctrl-C must not cut the clean-up short
                shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        with signals_deferred():      # nor leave `out` moved aside and nothing in its place
            aside = None
            try:
                if self.out.exists() or self.out.is_symlink():
                    aside = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-", dir=self.out.parent))
                    self.out.rename(aside / self.out.name)
                self.tmp.rename(self.out)
            except BaseException:
                if aside is not None:   # put the old one back (where that fails, it stays in `aside`)
                    moved = aside / self.out.name
                    if moved.exists() or moved.is_symlink():
                        moved.rename(self.out)
                    aside.rmdir()
                shutil.rmtree(self.tmp, ignore_errors=True)
                raise
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
        return False
