"""The LLM APIs the proxy reads streams of: one event-stream reader per API, each a small
table from an event's name or object type to what the event means.

A reader takes one complete SSE event (WHATWG HTML §9.2.6: its ``event:`` name, if any, and its
``data:`` lines joined) and answers a ``Reading`` (``reading.py``): content, usage, error, meta
or done, with the tokens it carries, the usage it reports, the error's type and, for the
Responses API, the event's ``sequence_number``. ``reader_for`` (``paths.py``) says which API a
request path speaks.

The readers are pure and never raise: whatever a backend sends (unknown events, malformed
JSON, any bytes) reads as ``meta`` with nothing counted, so a backend cannot crash the proxy
through them. An error event is told apart from ``meta`` because an error before any content
is what a failover decides on."""
