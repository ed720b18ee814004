"""User-facing errors: one plain sentence, exit code 2 at the CLI."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NoReturn


class KvreplayError(Exception):
    """Bad input or an environment problem the user can fix; never a bug.

    The message is a single sentence that says what is wrong and, where possible,
    what to do about it. The CLI prints it on stderr and exits with code 2.
    """


def exit_plainly(message: str) -> NoReturn:
    """End the process the way every refusal ends: one line on stderr, exit code 2."""
    print(f"kvreplay: error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(2)


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (160 characters at most, no final
    full stop), or its type's name when it has none: what a one-sentence refusal quotes."""
    text = str(exc).strip()
    return text.splitlines()[0][:160].rstrip(".") if text else type(exc).__name__


def plain_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a CLI command: a KvreplayError ends in one sentence on stderr and exit
    code 2, never a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except KvreplayError as exc:
            exit_plainly(str(exc))

    return wrapper
