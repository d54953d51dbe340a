"""What the exchange's parts see of it, and what an exchange needs of its owner.

An exchange (``exchange.py``) keeps its own life: its phases, the relay of the heads and the
body, its endings. Two concerns that grew around it live in modules of their own, and reach
it only through the ports below, which name exactly the members they use (never one with an
underscore), so that neither knows the exchange's class nor its private state:

- ``Routed`` (``placement.py``): where the exchange goes, its route, its group's budgets and
  admission queue, and the servers it tries. Placement sets the members it decides
  (``head`` once normalised, ``route``, ``group``, ``failover``, ``admission``) and moves the
  exchange's phase through ``move`` alone.
- ``Outliving`` (``surviving.py``): what the stream keeps to outlive its client (resume) or
  its backend (continuation). It changes the exchange's client through ``hand_to`` and its
  backend through ``release_upstream`` and ``continue_with``.
- ``ContinuedOwner`` (``continuing.py``): the exchange as the stream that continues its
  answer on another server sees it.

Nothing here imports ``exchange.py``, ``placement.py``, ``surviving.py`` or ``continuing.py``:
they import this module, so the core's import graph keeps no cycle. The records and helpers
named here (``Failover``, ``Admission``, ``Upload``, ``Survival``...) know nothing of the
exchange either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from muxproxy.core.ports import (
    ClientStream,
    ExchangeClient,
    Phase,
    ServerHost,
    UpstreamStream,
    UpstreamUser,
)
from muxproxy.core.streams.resume import Owner

if TYPE_CHECKING:
    from muxproxy.config import Route, Upstream
    from muxproxy.core.effects import Effects
    from muxproxy.core.exchange.admit import Admission
    from muxproxy.core.exchange.deadlines import Deadlines
    from muxproxy.core.exchange.exchange_states import ExchangeInput
    from muxproxy.core.exchange.failover import Failover
    from muxproxy.core.exchange.upload import Upload
    from muxproxy.core.messages import Fields, OwnBody, RequestHead
    from muxproxy.core.observe.access import RequestIds
    from muxproxy.core.streams.continuation import FollowedAnswer
    from muxproxy.core.streams.resume import Resumable, ResumeStore
    from muxproxy.core.streams.sseids import EventStamper
    from muxproxy.core.streams.survival import Survival
    from muxproxy.routing.aliases import Aliases


class ExchangeHost(ServerHost, Protocol):
    """What an exchange needs of the core that runs it."""

    @property
    def request_ids(self) -> RequestIds: ...
    @property
    def resumes(self) -> ResumeStore:
        """The resumable streams of this process (``resume.py``)."""

    @property
    def aliases(self) -> Aliases:
        """The model aliases' weights in force, and their choices (``routing/aliases.py``)."""

    def exchange_finished(self, exchange: object) -> None: ...


class ContinuedOwner(UpstreamUser, Protocol):
    """The exchange as ``continuing.ContinuedStream`` sees it: its stream id for the request
    head, its failover to count the new server's success, and the backend events it takes."""

    stream: int
    failover: Failover | None


class Hooks(Protocol):
    """An exchange's extension hooks as placement sees them (``hooked.ExchangeHooks``)."""

    @property
    def tenant(self) -> int | None:
        """The tenant an extension set, hashed (``admit.tenant_of``); None: the group's."""

    @property
    def chooses(self) -> bool:
        """Whether an extension has ``choose_server``."""

    def request_head(self, exchange: Any) -> bool:
        """Run the request-head hooks; True: route now (False: answered, or waiting)."""

    def choose_server(self, exchange: Any, failover: Failover) -> bool:
        """Let the extensions name the next try among the servers left; False: answered."""


class Routed(UpstreamUser, Protocol):
    """The exchange as ``placement.py`` sees it (also the pool's ``UpstreamUser``, on whose
    behalf a failover asks for streams, and the admission queue's waiter)."""

    fx: Effects
    host: ExchangeHost
    ident: int
    head: RequestHead
    route: Route | None
    group: Upstream | None
    failover: Failover | None
    admission: Admission | None
    upload: Upload
    deadlines: Deadlines
    request_id: bytes

    @property
    def phase(self) -> Phase: ...
    @property
    def upstream(self) -> UpstreamStream | None: ...
    @property
    def hooks(self) -> Hooks | None: ...
    def move(self, input: ExchangeInput) -> bool: ...
    def release_upstream(self, *, close: bool) -> None: ...
    def routed_by_model(self) -> bool:
        """Its body's model chose its route: True when a resume took it (``replay.py``)."""

    def fail(
        self,
        status: int,
        text: str,
        reason: str = "",
        *,
        extra: Fields = (),
        body: OwnBody | None = None,
    ) -> None: ...


class Outliving(ContinuedOwner, ClientStream, Owner, Protocol):
    """The exchange as ``surviving.py`` sees it: resume and continuation (also its client's
    stream, and the owner of the resumable stream it makes)."""

    fx: Effects
    host: ExchangeHost
    ident: int
    head: RequestHead
    group: Upstream | None
    upload: Upload
    deadlines: Deadlines
    request_id: bytes
    upstream_version: str | None
    survival: Survival | None

    @property
    def client(self) -> ExchangeClient: ...
    @property
    def upstream(self) -> UpstreamStream | None: ...
    @property
    def resumable(self) -> Resumable | None: ...
    @property
    def stamper(self) -> EventStamper | None: ...
    @property
    def answer(self) -> FollowedAnswer | None: ...

    def survive(self) -> Survival:
        """The survival record, made on first need."""

    def hand_to(self, client: ExchangeClient) -> ExchangeClient:
        """The response goes to ``client`` from now on; returns the old one."""

    def release_upstream(self, *, close: bool) -> None: ...
    def continue_with(self, upstream: UpstreamStream) -> None:
        """``upstream`` is the backend from now on (the stream that continues the answer)."""
