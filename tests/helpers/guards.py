"""A hang guard for code that might block forever."""

import contextlib
import signal


@contextlib.contextmanager
def alarm_guard(seconds: int):
    """Raise TimeoutError once the block has run ``seconds`` (SIGALRM, main thread only), so that an endless loop or
    a blocked wait fails its test instead of hanging the suite."""

    def fail(signum, frame):
        raise TimeoutError(f"hang guard: still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
