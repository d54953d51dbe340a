"""The proxy's own refusals of a request it cannot serve now, each saying why.

What it obeys:

- Every such refusal carries ``x-muxproxy-reason`` with one of five reasons, so a client, a
  load generator or an operator's log tells "come back later" from "nothing can serve this"
  without parsing prose:

  ============== ====== ==================================================================
  reason         status when
  ============== ====== ==================================================================
  queue_full     429    every candidate server is full and ``queue.max`` requests wait
  queue_timeout  429    it waited in the queue past its class's deadline (``max_wait``)
  rate_limited   429    its tenant's request rate (``requests_per_minute``) or requests
                        in flight (``max_concurrent``) are spent
  budget         429    its tenant's token budget (``tokens_per_minute``) is spent, or the
                        request is larger than the whole budget
  no_server      503    no server of its group may take it (down, drained, weight 0, the
                        group removed while it waited)
  no_server      502    every server tried failed before answering (``next_upstream``)
  ============== ====== ==================================================================

  The status stays what it was (what clients and SDKs retry on); ``Retry-After`` and the
  ``x-ratelimit-*`` fields (RFC 9110 §10.2.3; OpenAI's) come with it as before. A refusal
  by the tokens and the requests at once is ``budget``. A 504 (a server too slow) and the
  fleet store's 503 (``on_store_error = "closed"``) are not refusals for want of a server or
  a budget, and carry no reason.
- The body is the request's API's own error object, chosen by its path
  (``core/apis/paths.py``), as that API's SDK reads it:

  - OpenAI paths (chat completions, completions, responses):
    ``{"error": {"message", "type", "param": null, "code": <reason>}}``, ``type`` as
    OpenAI's own 429s say which limit (``requests``, ``tokens``), ``server_error`` for
    ``no_server``;
  - ``/v1/messages``: Anthropic's ``{"type": "error", "error": {"type", "message"}}``, with
    ``rate_limit_error`` (``rate_limited``, ``budget``), ``overloaded_error`` (the queue) or
    ``api_error`` (``no_server``);
  - any other path: the body of ``core/http/errors.py`` as before (plain text, or the
    OpenAI object on an ``api = "openai"`` route), with the field.
- Each refusal is counted by group and reason (``admissions_refused_total``).

The reason travels to the answer as its field: ``body_for`` reads it back from the fields of
the answer being sent (``heads.send_error_answer``), so the field and the body cannot say
two things.
"""

from __future__ import annotations

import enum
import json

from muxproxy.core.apis.paths import Api, api_for
from muxproxy.core.exchange.exchangeports import Routed
from muxproxy.core.messages import Fields, OwnBody

__all__ = ["FIELD", "Reason", "body_for", "refuse"]

FIELD = b"x-muxproxy-reason"
"""The response field that names the reason of a refusal."""


class Reason(enum.Enum):
    """Why the proxy refused a request itself (the module's table)."""

    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    RATE_LIMITED = "rate_limited"
    BUDGET = "budget"
    NO_SERVER = "no_server"


_OPENAI_TYPE = {
    Reason.QUEUE_FULL: "requests",
    Reason.QUEUE_TIMEOUT: "requests",
    Reason.RATE_LIMITED: "requests",
    Reason.BUDGET: "tokens",
    Reason.NO_SERVER: "server_error",
}
_ANTHROPIC_TYPE = {
    Reason.QUEUE_FULL: "overloaded_error",
    Reason.QUEUE_TIMEOUT: "overloaded_error",
    Reason.RATE_LIMITED: "rate_limit_error",
    Reason.BUDGET: "rate_limit_error",
    Reason.NO_SERVER: "api_error",
}
_BY_VALUE = {reason.value.encode("ascii"): reason for reason in Reason}
_JSON = b"application/json"


def refuse(
    exchange: Routed,
    reason: Reason,
    status: int,
    text: str,
    outcome: str = "",
    *,
    extra: Fields = (),
) -> None:
    """Answer ``exchange`` with ``status``, saying ``text`` for ``reason`` (counted in its
    group); ``outcome``: the access log's, if not ``text``; ``extra``: more fields."""
    group = exchange.group
    if group is not None:
        exchange.host.measurements.admission(group.name, reason.value)
    fields = [(FIELD, reason.value.encode("ascii")), *extra]
    exchange.fail(status, text, outcome, extra=fields)


def body_for(target: bytes, text: str, fields: Fields) -> OwnBody | None:
    """The body of an answer with ``fields`` to a request for ``target``: its API's error
    object when the fields name a refusal's reason and the path an API; None otherwise
    (the body as ``core/http/errors.py`` makes it)."""
    reason = next((_BY_VALUE.get(v) for k, v in fields if k == FIELD), None)
    if reason is None:
        return None
    api = api_for(target.decode("latin-1"))
    if api is None:
        return None
    document: dict[str, object]
    if api is Api.MESSAGES:
        document = {"type": "error", "error": {"type": _ANTHROPIC_TYPE[reason], "message": text}}
    else:  # the OpenAI APIs: chat completions, completions, responses
        kind = _OPENAI_TYPE[reason]
        document = {"error": {"message": text, "type": kind, "param": None, "code": reason.value}}
    return OwnBody(content_type=_JSON, data=json.dumps(document).encode())
