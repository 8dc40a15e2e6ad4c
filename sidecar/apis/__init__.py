"""Generative-serving protocol modules of the sidecar: the request body's model (``json_scan``),
server-sent events (``sse``), and the answers of the OpenAI-compatible API (``openai``) and of
Triton's generate extension (``triton_generate``), reported through the hooks of ``hooks``.
README.md beside this file says how the transport plugs them in.
"""

from .hooks import Hooks, NoHooks, StreamEnd
from .json_scan import OPENAI_FIELDS, BodyScanner, Outcome
from .openai import OpenAIAnswer, is_event_stream
from .sse import Event, SSEParser
from .triton_generate import TritonGenerateAnswer

__all__ = [
    "OPENAI_FIELDS",
    "BodyScanner",
    "Event",
    "Hooks",
    "NoHooks",
    "OpenAIAnswer",
    "Outcome",
    "SSEParser",
    "StreamEnd",
    "TritonGenerateAnswer",
    "is_event_stream",
]
