"""User-facing errors: one line saying what is wrong and how to fix it."""


class HarnessError(Exception):
    """A mistake in the user's input or environment, not a bug in the harness.

    The command line prints the message as one line and exits non-zero,
    without a traceback.
    """

    exit_code = 2


def one_line(err: BaseException, with_type: bool = False) -> str:
    """An exception as one line of text: the first non-empty line of its message, or its type's
    name when it has none. with_type: prefix the type's name ("CommError: network is unreachable")."""
    line = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    if not line:
        return type(err).__name__
    return f"{type(err).__name__}: {line}" if with_type else line
