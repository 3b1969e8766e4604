"""Ctrl-C while a command starts (imports, loading, compiling): stdlib only, so the command line can import it before
numpy or JAX, whose imports a Ctrl-C may interrupt."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


def interrupted_import(exc: BaseException) -> bool:
    """Whether an ImportError came from a Ctrl-C: one that lands while a C extension (numpy, jaxlib) initialises is
    raised again as "ImportError: Encountered an error while initializing the extension"."""
    seen = exc
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@contextlib.contextmanager
def startup_interrupts():
    """A Ctrl-C while the block runs (imports, loading, compiling) ends it with KeyboardInterrupt, even one Python
    drops: raised inside a garbage-collection callback (JAX has one), it was printed as "Exception ignored" and
    loading went on, the server started. The SIGINT handler notes each one, and the block's end raises it again.
    In the main thread only (elsewhere signal handlers cannot be set: the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupted = []

    def handler(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    def unraisable(info):  # (the dropped one is raised at the end: no "Exception ignored" traceback for it)
        if not issubclass(info.exc_type, KeyboardInterrupt):
            previous_hook(info)

    previous, previous_hook = signal.signal(signal.SIGINT, handler), sys.unraisablehook
    sys.unraisablehook = unraisable
    try:
        yield
    except Exception as exc:  # (an error after a dropped Ctrl-C: the Ctrl-C wins, as the user asked to stop)
        if interrupted:
            raise KeyboardInterrupt from exc
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook
    if interrupted:
        raise KeyboardInterrupt
