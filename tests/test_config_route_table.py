"""``RouteTable`` (``config/routes.py``): the route a request takes, from a per-configuration
index, is the route of the linear rule on every route table and path, with and without models."""

from __future__ import annotations

from collections.abc import Iterable

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from muxproxy.config import Route, quick_config
from muxproxy.config.routes import RouteTable, model_matches

# A small alphabet, so that random prefixes and paths share beginnings often.
_TEXT = st.text(alphabet="/ab.", max_size=6)
_MODELS = st.sampled_from(["m1", "m2", "m*", "x"])
_ROUTES = st.lists(
    st.builds(
        Route,
        prefix=_TEXT,
        upstream=st.sampled_from(["u0", "u1", "u2"]),
        models=st.lists(_MODELS, max_size=2).map(tuple),
    ),
    max_size=8,
)


def choose_route(routes: Iterable[Route], path: str, model: str | None) -> Route | None:
    """The route of a request for ``path`` whose body names ``model`` (None: not known), as
    ``config/routes.py``'s header says, walking every route; None: no route serves it."""
    best: Route | None = None
    best_rank = (-1, -1)
    for route in routes:
        if not path.startswith(route.prefix):
            continue
        if route.models and (model is None or not model_matches(model, route.models)):
            continue
        rank = (len(route.prefix), 1 if route.models else 0)
        if rank > best_rank:  # strictly: the first of equal rank, in the file's order, wins
            best, best_rank = route, rank
    return best


def model_decides(routes: Iterable[Route], path: str) -> bool:
    """Whether a request's model can change which of ``routes`` serves ``path``: a route with
    ``models`` matches the path with a prefix at least as long as the longest route without
    (which would win whatever the model)."""
    plain = -1
    modelled = -1
    for route in routes:
        if path.startswith(route.prefix):
            if route.models:
                modelled = max(modelled, len(route.prefix))
            else:
                plain = max(plain, len(route.prefix))
    return modelled >= plain and modelled >= 0


def linear_by_path(routes: list[Route], path: str) -> Route | None:
    """The rule of a configuration without ``models``, as a walk over every route: the
    longest matching prefix, the first of equal ones in the file's order."""
    best: Route | None = None
    for route in routes:
        if path.startswith(route.prefix) and (best is None or len(route.prefix) > len(best.prefix)):
            best = route
    return best


@settings(max_examples=500, deadline=None)
@given(routes=_ROUTES, path=_TEXT, model=st.none() | st.sampled_from(["m1", "m2", "m3", "x"]))
def test_the_table_chooses_as_the_linear_rule(
    routes: list[Route], path: str, model: str | None
) -> None:
    table = RouteTable(routes)
    assert table.choose(path, model) is choose_route(routes, path, model)
    assert table.model_decides(path) == model_decides(routes, path)
    plain = [route for route in routes if not route.models]
    assert RouteTable(plain).choose(path, model) is linear_by_path(plain, path)


def test_route_for_picks_the_longest_prefix_among_many_routes() -> None:
    routes = tuple(Route(prefix=f"/r{i}/", upstream="default") for i in range(200))
    config = quick_config("127.0.0.1:0", ["127.0.0.1:9"])
    config = attrs.evolve(config, routes=(*routes, Route(prefix="/r7/x", upstream="default")))
    assert config.route_for(b"/r7/x/y") is config.routes[-1]
    assert config.route_for(b"/r7/y") is config.routes[7]
    assert config.route_for(b"/r199/") is config.routes[199]
    assert config.route_for(b"/s") is None
