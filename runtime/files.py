"""Directories written whole or not at all: the staging directory of an engine export and of a datastore build."""
from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
import threading
from pathlib import Path


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


class StagingDir:
    """Write an engine directory beside its final place and move it there only when complete.
    An interrupted or failed export leaves nothing at `out` (and removes its staging directory)."""

    def __init__(self, out: Path, force: bool):
        self.out, self.force = Path(out), force

    def __enter__(self) -> Path:
        # Ctrl-C raises KeyboardInterrupt, but one that lands in a destructor is printed and swallowed; the flag makes
        # sure an interrupted export never moves into place.
        self.interrupted, self.previous = False, None
        if threading.current_thread() is threading.main_thread() and callable(signal.getsignal(signal.SIGINT)):
            self.previous = signal.signal(signal.SIGINT, self._on_sigint)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.out.parent.glob(f".{self.out.name}.partial-*"):  # left by a killed export
            shutil.rmtree(stale, ignore_errors=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=self.out.parent))
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
        if self.out.exists():
            old = self.out.with_name(f".{self.out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            self.out.rename(old)
            self.tmp.rename(self.out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            self.tmp.rename(self.out)
        return False
