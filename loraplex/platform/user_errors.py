"""How the command line reports a user error: one ``error: ...`` line on stderr, exit status 2.

Shared by ``loraplex.cli`` (model commands) and the platform's commands (``platform/cli.py``,
``demo up``); imports nothing heavy so that ``loraplex --help`` stays fast.
"""

from __future__ import annotations

import sys

USER_ERROR_STATUS = 2


def fail(message: str) -> int:
    """Print ``error: <message>`` on one line (newlines collapsed) to stderr; returns ``USER_ERROR_STATUS``."""
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return USER_ERROR_STATUS
