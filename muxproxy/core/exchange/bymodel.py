"""Routing by the model a request's body names, and model aliases: before its route is known.

What it obeys:

- Only where it can matter: a configuration with routes that have ``models`` or with
  ``[models]`` aliases (``Config.by_model``), a request with a body, on a path that speaks
  an LLM API (``apis/paths.api_for``: chat completions, completions, responses, messages,
  embeddings), and, without aliases, where a route with ``models`` could win over the route
  the path alone takes (``routes.RouteTable.model_decides``). Every other request is routed from its
  head as before, at no extra cost.
- Bounded: the body is held (BUFFERING, no route yet) only until ``routing/models.find_model``
  decides, which reads at most ``limits.max_route_body`` bytes, and never more than the
  stream's ``high_water`` (past it the client is stopped, so waiting longer would wait for
  ever). A body with no ``model`` within them, or no JSON object, is routed by path, the
  routes with ``models`` skipped.
- A body naming its model twice is refused with 400 (RFC 8259 §4 leaves duplicate names to
  the parser; the proxy and the engine could each take another one: a request would be
  routed as one model and served as another).
- A model no route serves gets 404 with the API's own error object (``model_not_found`` of
  OpenAI's API; ``not_found_error`` of Anthropic's on ``/v1/messages``), which the SDKs
  raise as their NotFoundError.
- An alias (``[models.NAME]``) names one of its targets (``routing/aliases.py``) by the
  request's session key, as the group that serves the alias's first target reads it
  (``sticky.sources``): a conversation keeps its model version. The body's ``model`` is
  rewritten to the target (``rewrite_model``: nothing else changes) and its Content-Length
  follows; a body without one (HTTP/1.1 chunked, HTTP/2) needs nothing more. It is then
  routed by the target. The choice is made once, before anything is sent: a weight change
  later moves no request in flight.

The body is held whole while the model is read, nothing sent: once the route is found it is
kept for replays up to its group's ``replay_buffer``, as if the group had been known from the
start (``RequestBody.held``).
"""

from __future__ import annotations

import json
import sys

import attrs

from muxproxy.config.records import ModelAlias
from muxproxy.core.apis.paths import Api, api_for
from muxproxy.core.exchange.body import RequestBody
from muxproxy.core.exchange.exchange_states import ExchangeInput
from muxproxy.core.exchange.exchangeports import Routed
from muxproxy.core.messages import OwnBody
from muxproxy.core.ports import RequestPhase
from muxproxy.routing.llmrequest import INVALID, parse_json_body
from muxproxy.routing.models import Duplicate, Found, NeedMore, NotFound, find_model, rewrite_model
from muxproxy.routing.sticky import session_key_from_body, session_key_from_head

__all__ = ["hold_for_model", "model_not_found", "read_model", "reads_model"]


def reads_model(exchange: Routed) -> bool:
    """Whether ``exchange`` is routed by its body's model (read first: ``hold_for_model``)."""
    config = exchange.fx.config
    if not config.reads_models or exchange.upload.phase is not RequestPhase.BODY:
        return False
    path = exchange.head.target.decode("latin-1")
    if api_for(path) is None:
        return False
    # An alias is resolved on any route; without one the model matters only where a route
    # with ``models`` could win over the route the path alone takes, or to telemetry (its
    # spans and metrics name the model: docs/telemetry.md).
    return (
        bool(config.models)
        or config.telemetry is not None
        or config.route_table.model_decides(path)
    )


def hold_for_model(exchange: Routed) -> None:
    """Hold the body, all of it, until its model is read (BUFFERING without a route)."""
    exchange.upload.body = RequestBody(sys.maxsize)
    exchange.move(ExchangeInput.BUFFER)


def read_model(exchange: Routed) -> bool:
    """BUFFERING without a route: read the model from the body held so far. True: the route
    and the group are set, placement goes on; False: more body is needed, or answered."""
    fx, upload, head = exchange.fx, exchange.upload, exchange.head
    config = fx.config
    complete = upload.phase is RequestPhase.COMPLETE
    prefix = upload.body.prefix()
    limit = min(config.limits.max_route_body, fx.limits.high_water)
    model: str | None = None
    match find_model(prefix, complete=complete, limit=limit):
        case NeedMore():
            return False
        case Duplicate(model=first):
            text = "the body names its model twice; send one model member"
            exchange.fail(400, text, f"duplicate model {first!r}", body=_invalid(head.target, text))
            return False
        case NotFound():
            model = None
        case Found(model=model, span=span):
            upload.model = model
            alias = config.models.get(model)
            if alias is not None:
                model = upload.served_model = _resolve(exchange, alias, prefix, complete, span)
                if model is None:
                    return False
    route = config.route_for(head.target, model)
    if route is None:
        if model is None:
            exchange.fail(404, "no route for this path")
        else:
            reason = f"no route serves the model {model!r}"
            exchange.fail(404, reason, reason, body=model_not_found(head.target, model))
        return False
    exchange.route = route
    group = exchange.group = config.upstreams[route.upstream]
    upload.body.held(group.next_upstream.replay_buffer)
    return True


def _resolve(
    exchange: Routed, alias: ModelAlias, prefix: bytes, complete: bool, span: tuple[int, int]
) -> str | None:
    """The target of ``alias`` for this request, written into its body; None: answered."""
    model = exchange.host.aliases.pick(alias, _session_key(exchange, alias, prefix, complete))
    if model is None:
        exchange.fail(503, f"the model alias {alias.name!r} has no target with a weight above 0")
        return None
    body = rewrite_model(prefix, span, model)
    exchange.upload.body.replace(body)
    shift = len(body) - len(prefix)
    if shift:
        # The declared length moves by what the rewrite added: the body held so far may
        # be only its start (the model found before the rest came), RFC 9110 §8.6.
        head = exchange.head
        fields = [
            (name, _shifted(value, shift) if name.lower() == b"content-length" else value)
            for name, value in head.headers
        ]
        exchange.head = attrs.evolve(head, headers=fields)
    return model


def _shifted(length: bytes, shift: int) -> bytes:
    """A Content-Length value (digits: the HTTP adapters checked it) moved by ``shift``."""
    return str(int(length) + shift).encode("ascii")


def _session_key(
    exchange: Routed, alias: ModelAlias, prefix: bytes, complete: bool
) -> bytes | None:
    """The request's session key as the group serving ``alias``'s first target reads it."""
    config, head = exchange.fx.config, exchange.head
    route = config.route_for(head.target, alias.targets[0].model)
    if route is None:
        return None
    sources = config.upstreams[route.upstream].sticky.sources
    key, need_body = session_key_from_head(sources, head.headers, head.target)
    if not need_body:
        return key
    # The model is read once the JSON object ended: the body is whole even when its end
    # (HTTP/1.1 chunked's last chunk, HTTP/2 END_STREAM) is still to come.
    document = parse_json_body(prefix)
    whole = complete or document is not INVALID
    return session_key_from_body(sources, head.headers, head.target, prefix, whole, document)


def model_not_found(target: bytes, model: str) -> OwnBody:
    """The API's own 404 for a model no route serves."""
    if api_for(target.decode("latin-1")) is Api.MESSAGES:
        error: dict[str, object] = {
            "type": "error",
            "error": {"type": "not_found_error", "message": f"model: {model}"},
        }
    else:
        message = f"The model `{model}` does not exist or you do not have access to it."
        error = {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        }
    return OwnBody(content_type=b"application/json", data=json.dumps(error).encode())


def _invalid(target: bytes, text: str) -> OwnBody:
    """The API's own 400 for a body it would refuse as invalid."""
    if api_for(target.decode("latin-1")) is Api.MESSAGES:
        error: dict[str, object] = {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": text},
        }
    else:
        error = {
            "error": {
                "message": text,
                "type": "invalid_request_error",
                "param": "model",
                "code": None,
            }
        }
    return OwnBody(content_type=b"application/json", data=json.dumps(error).encode())
