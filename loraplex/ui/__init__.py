"""Gradio admin console and chat playground, mounted on the platform's FastAPI app at ``/ui``.

Depends on the platform (``loraplex.platform``) and Gradio; nothing imports it back.
"""

from loraplex.ui.console import CONSOLE_PATH, build_console, mount_console

__all__ = ["CONSOLE_PATH", "build_console", "mount_console"]
