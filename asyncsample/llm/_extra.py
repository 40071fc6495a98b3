"""The ``llm`` extra's HTTP client, imported in one place so that a missing extra says which.

aiohttp serves as the client (:class:`~asyncsample.llm.ChatAgent`) and as the server of the
test double and the example's tool (:mod:`asyncsample.llm.testing`): one dependency for both.
"""

from __future__ import annotations

try:
    import aiohttp
    from aiohttp import web
except ImportError as exc:  # pragma: no cover - exercised with the extra uninstalled
    raise ImportError(
        "asyncsample.llm needs the 'llm' extra (aiohttp): pip install 'asyncsample[llm]'"
    ) from exc

__all__ = ["aiohttp", "web"]
