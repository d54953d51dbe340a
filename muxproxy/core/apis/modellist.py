"""``GET /v1/models`` and ``GET /v1/models/{id}`` answered by the proxy, from the models its
groups serve (``routing/modelcatalog.py``), in the shape of the API the client speaks.

What it obeys:

- The paths are exact: ``/v1/models`` and ``/v1/models/{id}`` (the id percent-decoded, so a
  Hugging Face name ``org/name`` arrives whole, as ``org%2Fname`` or as ``org/name``), with
  a query or not. ``GET`` and ``HEAD`` only: another method is not ours to answer.
- The proxy answers only while it knows at least one model (configured or learnt); with none
  the request is proxied as any other, so a configuration without ``models`` and whose
  engines have not answered yet behaves as before.
- The OpenAI shape (``{"object": "list", "data": [{"id", "object": "model", "created",
  "owned_by"}]}``; a model object; a 404 whose error ``code`` is ``model_not_found``) by
  default. The Anthropic shape when the request carries ``anthropic-version`` (every
  Anthropic SDK sends it): ``{"data": [{"type": "model", "id", "display_name",
  "created_at"}], "has_more", "first_id", "last_id"}``, paged by ``limit`` (1..1000,
  default 20), ``after_id`` and ``before_id`` as Anthropic's API pages it; a 404 is its
  ``not_found_error``, a bad ``limit`` its ``invalid_request_error``.

Pure: a function from the request head and the known models to the status and the body;
``placement.py`` sends it as one of the proxy's own answers (``errors.py``).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from urllib.parse import parse_qs, unquote

from muxproxy.core.messages import OwnBody, RequestHead
from muxproxy.routing.modelcatalog import ModelInfo

__all__ = ["PATH", "models_answer"]

PATH = b"/v1/models"
_ITEM = PATH + b"/"
_JSON = b"application/json"
ANTHROPIC_LIMIT = 20
"""Models in one page of Anthropic's list when the request names no ``limit``."""
ANTHROPIC_MAX_LIMIT = 1000


def models_answer(head: RequestHead, known: Sequence[ModelInfo]) -> tuple[int, OwnBody] | None:
    """The status and body of the proxy's answer to ``head``, or None when it is not ours to
    answer (another path or method, or no model known)."""
    if not known or head.method not in (b"GET", b"HEAD"):
        return None
    path, _, query = head.target.partition(b"?")
    if path != PATH and not (path.startswith(_ITEM) and len(path) > len(_ITEM)):
        return None
    anthropic = any(name == b"anthropic-version" for name, _ in head.headers)
    if path == PATH:
        if anthropic:
            return _anthropic_page(known, query)
        return 200, _json({"object": "list", "data": [_openai(model) for model in known]})
    name = unquote(path[len(_ITEM) :].decode("latin-1"))
    for model in known:
        if model.id == name:
            return 200, _json(_anthropic(model) if anthropic else _openai(model))
    if anthropic:
        return 404, _anthropic_error("not_found_error", f"model: {name}")
    error = {
        "message": f"The model '{name}' does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    return 404, _json({"error": error})


def _json(document: object) -> OwnBody:
    return OwnBody(content_type=_JSON, data=json.dumps(document).encode())


def _openai(model: ModelInfo) -> dict[str, object]:
    return {"id": model.id, "object": "model", "created": model.created, "owned_by": model.owned_by}


def _anthropic(model: ModelInfo) -> dict[str, object]:
    created = datetime.datetime.fromtimestamp(model.created, tz=datetime.UTC)
    return {
        "type": "model",
        "id": model.id,
        "display_name": model.id,
        "created_at": created.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _anthropic_error(kind: str, message: str) -> OwnBody:
    return _json({"type": "error", "error": {"type": kind, "message": message}})


def _anthropic_page(known: Sequence[ModelInfo], query: bytes) -> tuple[int, OwnBody]:
    """One page of Anthropic's list: ``limit`` models after ``after_id`` or before
    ``before_id`` (an id not listed pages from the start, or to the end)."""
    params = parse_qs(query.decode("latin-1"))
    limit_text = params.get("limit", [str(ANTHROPIC_LIMIT)])[0]
    # ASCII digits, few: ``int`` takes other digits (``"²"``) and refuses 4,300 of them.
    text_ok = limit_text.isascii() and limit_text.isdigit() and len(limit_text) <= 4
    if not text_ok or not 1 <= int(limit_text) <= ANTHROPIC_MAX_LIMIT:
        message = f"limit: expected an integer from 1 to {ANTHROPIC_MAX_LIMIT}"
        return 400, _anthropic_error("invalid_request_error", message)
    limit = int(limit_text)
    ids = [model.id for model in known]
    after, before = params.get("after_id", [None])[0], params.get("before_id", [None])[0]
    if before is not None:
        end = ids.index(before) if before in ids else len(ids)
        start = max(0, end - limit)
        has_more = start > 0
    else:
        start = ids.index(after) + 1 if after is not None and after in ids else 0
        end = min(len(ids), start + limit)
        has_more = end < len(ids)
    page = known[start:end]
    document = {
        "data": [_anthropic(model) for model in page],
        "has_more": has_more,
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
    }
    return 200, _json(document)
