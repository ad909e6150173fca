"""What every subcommand shares: exit codes, error lines, plain-text tables, and the rich console.

Each subcommand shows its output with rich when it is installed (the ``demo`` extra) and as
aligned plain text otherwise; both paths start here so widths and alignment agree everywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.console import Console

# Exit codes of the ``kvroute`` command. 0-2 are every subcommand's; 3-8 name ``discover``'s
# failure kinds (see ``kvroute discover --help``).
EXIT_OK = 0
EXIT_FAILED = 1  # the command could not do its job (unreachable engine, unreadable file, ...)
EXIT_USAGE = 2  # argparse's own code for bad arguments; also options that cannot work together
EXIT_UNREACHABLE = 3
EXIT_EVENTS_DISABLED = 4
EXIT_UNUSABLE_SOURCE = 5
EXIT_MALFORMED_ANSWER = 6
EXIT_TOO_MANY_SOURCES = 7
EXIT_REJECTED = 8  # the server refused the call (unauthenticated, permission denied, not an engine)
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT

# Columns of rich output written to a file or pipe: rich assumes 80 there, which wraps the tables,
# and a log has room.
LOG_WIDTH = 140


def error(command: str, message: object, code: int, err: TextIO | None = None) -> int:
    """Write ``kvroute COMMAND: message`` to stderr (or ``err``) and return ``code``, for ``return error(...)``."""
    print(f"kvroute {command}: {message}", file=err or sys.stderr)
    return code


def align(rows: Sequence[Sequence[str]], *, right_from: int | None = None) -> list[str]:
    """Rows of cells as aligned lines, two spaces apart; columns from ``right_from`` on are right-aligned."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(w) if right_from is not None and i >= right_from else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    ]


def console(out: TextIO) -> Console:
    """A rich console on ``out``: the terminal's width, or `LOG_WIDTH` off a terminal. ImportError without rich."""
    from rich.console import Console

    return Console(file=out, width=None if out.isatty() else LOG_WIDTH)
