"""User-facing errors: one plain sentence, exit code 2 at the CLI."""


class KvreplayError(Exception):
    """Bad input or an environment problem the user can fix; never a bug.

    The message is a single sentence that says what is wrong and, where possible,
    what to do about it. The CLI prints it on stderr and exits with code 2.
    """
