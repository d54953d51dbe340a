"""Extension hooks: the interface an embedder or operator implements (:mod:`.api`) and its
loading from the configuration (:mod:`.loading`). See ``docs/extending.md``."""

from __future__ import annotations

from muxproxy.extensions.api import (
    Answer,
    Decision,
    Extension,
    HeaderRewrite,
    Outcome,
    Request,
    Response,
    Settings,
)
from muxproxy.extensions.loading import LoadError, load_extension

__all__ = [
    "Answer",
    "Decision",
    "Extension",
    "HeaderRewrite",
    "LoadError",
    "Outcome",
    "Request",
    "Response",
    "Settings",
    "load_extension",
]
