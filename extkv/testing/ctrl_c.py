"""Ctrl-C that reaches Python, for tests that send SIGINT.

Theory of operation
-------------------
A process started as a background job (`cmd &` in a script, which is how
many CI runners and nightly jobs start the suite) inherits SIGINT ignored,
and Python keeps an ignored SIGINT ignored: it installs its own handler
(`signal.default_int_handler`, which raises KeyboardInterrupt) only where
it found the default action. A test that sends itself SIGINT to prove what
Ctrl-C does would then wait for an interrupt that never lands, and fail on
how the suite was started rather than on extkv. `python_handles_ctrl_c()`
gives the test Python's handler for its duration and puts back whatever
was there; a test that signals a child Python process starts it the same
way (`PYTHON_HANDLES_CTRL_C`, the line its `-c` code begins with).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

#: The first line of a child's `python -c` code that a test sends SIGINT.
PYTHON_HANDLES_CTRL_C = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


@contextlib.contextmanager
def python_handles_ctrl_c() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in the main thread inside the block,
    whatever this process inherited; the handler before it is back after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
