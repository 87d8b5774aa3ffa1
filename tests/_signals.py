"""Signal set-up shared by tests that Ctrl-C a subprocess."""

import signal


def default_sigint() -> None:
    """`preexec_fn` of a subprocess to be Ctrl-C'd: SIGINT at its default, as under a terminal.
    A shell that runs pytest in the background (``cmd &``, nohup, some CI runners) ignores
    SIGINT, children inherit that, and Python then never installs its KeyboardInterrupt
    handler, so the signal would be lost."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
