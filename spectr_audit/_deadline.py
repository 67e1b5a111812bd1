"""A time limit on a call of third-party code (a verifier, a generator, a scorer).

In the main thread on POSIX, ``signal.setitimer(ITIMER_REAL)`` and a ``SIGALRM`` handler that
raises: it stops pure-Python loops and interrupts blocking calls such as ``time.sleep``.  A timer
armed by someone else (pytest-timeout, say) is saved and re-armed with what is left of it.
Elsewhere (another thread, or no ``SIGALRM``), a watchdog thread raises the exception in the calling
thread with ``PyThreadState_SetAsyncExc``: it stops pure-Python code at its next bytecode, but not
a blocking system call until that returns.  Either way a C extension that never returns to the
interpreter is not stopped until it does.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import threading
import time
from typing import Iterator, Optional

__all__ = ["call_limit"]

_state = threading.local()


def _alarm_usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _alarm(seconds: float, message: str, error: type) -> Iterator[None]:
    def on_alarm(signum, frame):
        raise error(message)

    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    previous_delay, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay:  # someone else's timer: re-arm it with what is left (at least a tick)
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, previous_delay - (time.monotonic() - start)))


@contextlib.contextmanager
def _watchdog(seconds: float, message: str, error: type) -> Iterator[None]:
    target = threading.get_ident()
    lock = threading.Lock()
    state = {"inside": True, "fired": False}
    # SetAsyncExc raises a class, instantiated without arguments: one that carries the message.
    exception = type(error.__name__, (error,), {"__init__": lambda self: error.__init__(self, message)})

    def fire():
        with lock:
            if state["inside"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), ctypes.py_object(exception))

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with lock:
            state["inside"] = False
        # An exception injected but not yet delivered must not escape later, elsewhere.
        if state["fired"]:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), None)


@contextlib.contextmanager
def call_limit(seconds: Optional[float], message: str, error: type = TimeoutError) -> Iterator[None]:
    """Raise ``error(message)`` in the block when it runs past ``seconds`` (None or 0: no limit).

    Nested limits: the outermost one holds (an inner call runs within the outer's time).
    """
    if not seconds or getattr(_state, "depth", 0):
        yield
        return
    _state.depth = 1
    try:
        with (_alarm if _alarm_usable() else _watchdog)(seconds, message, error):
            yield
    finally:
        _state.depth = 0
