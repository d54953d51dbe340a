"""A fake OpenAI-compatible LLM backend, for muxproxy's tests, ``muxproxy demo`` and benchmarks.

Modules, one job each: ``app.py``, the ASGI 3 application (:class:`FakeLLM`: what it
answers, its counters); ``answer.py``, the text it answers (one fixed token sequence, and
continuing a partial one: ``continue_final_message``); ``completions.py``, the
chat-completion objects it sends (chunks, server-sent events, the whole completion, usage);
``responses.py``, its whole-body
responses (JSON, bytes, OpenAI-style errors, with the common headers); ``knobs.py``, its
knobs (the ``x-fake-*`` request headers and the command-line options, with the table of
what each does); ``server.py``, serving it with Hypercorn's Trio worker
(:func:`serve_fakellm`: HTTP/1.1 and h2c on one port, and the Hypercorn quirks worked
around) and the command line (``muxproxy fakellm``, ``python -m muxproxy.testing.fakellm``).
The opt-in model of a GPU inference engine behind the app: ``engine.py`` (pure: prompt
tokens, the prefix KV cache, the options), ``scheduler.py`` (its Trio side: generations
first come first served in ``max_running`` slots), ``steps.py`` (pure: what one step of
continuous batching prefills and decodes), ``batch.py`` (the loop of those steps, with
``prefill_chunk``), ``metrics.py`` (``GET /metrics`` under vLLM's metric names) and
``lora.py`` (the LoRA adapters it holds and reports). This package hands on their public
names.
"""

from __future__ import annotations

from muxproxy.testing.fakellm.answer import reply_text, tokens_text
from muxproxy.testing.fakellm.app import MODEL, FakeBackendDied, FakeLLM
from muxproxy.testing.fakellm.knobs import add_arguments
from muxproxy.testing.fakellm.server import hypercorn_config, main, run, serve_fakellm

__all__ = [
    "MODEL",
    "FakeBackendDied",
    "FakeLLM",
    "add_arguments",
    "hypercorn_config",
    "main",
    "reply_text",
    "run",
    "serve_fakellm",
    "tokens_text",
]
