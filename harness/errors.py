"""User-facing errors: one line saying what is wrong and how to fix it."""


class HarnessError(Exception):
    """A mistake in the user's input or environment, not a bug in the harness.

    The command line prints the message as one line and exits non-zero,
    without a traceback.
    """

    exit_code = 2
