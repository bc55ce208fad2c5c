"""The run layer's edges to other trainers and protocols: the OpenEnv server, TRL and SkyRL adapters."""

from __future__ import annotations

import importlib
import ipaddress
import sys


def import_openenv_core() -> None:
    """Import `openenv.core` without its optional web playground.

    openenv.core imports its gradio playground at import time: about 9 s of CPU in every process,
    more than the rest of a server's start. Our servers and clients use no playground, and openenv
    falls back to none when gradio is missing, so a process that has imported neither openenv.core
    nor gradio gets openenv without it; any other process is left as it is.
    """
    if "openenv.core" in sys.modules or "gradio" in sys.modules:
        return
    sys.modules["gradio"] = None  # makes `import gradio` raise ModuleNotFoundError
    try:
        importlib.import_module("openenv.core")
    finally:
        del sys.modules["gradio"]


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (a host name that merely starts with one is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
