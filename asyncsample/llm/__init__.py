"""LLM agents: :class:`ChatAgent` asks any OpenAI-compatible chat-completions endpoint (vLLM,
SGLang, hosted APIs) for each env's action. Needs the ``llm`` extra
(``pip install 'asyncsample[llm]'``: aiohttp); :mod:`asyncsample.llm.testing` has a local
server of the same protocol for tests and examples.
"""

from asyncsample.errors import AgentRowsError, ChatRequestError, ChatTimeoutError
from asyncsample.llm._extra import aiohttp as _aiohttp  # first: a missing extra says which
from asyncsample.llm.chat import ChatAgent, ChatReply, parse_completion

del _aiohttp

__all__ = [
    "AgentRowsError",
    "ChatAgent",
    "ChatReply",
    "ChatRequestError",
    "ChatTimeoutError",
    "parse_completion",
]
