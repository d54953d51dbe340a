"""What the demo has seen: every turn of every conversation, the backends, the event log.

Pure: no Trio, no I/O, no clock (times come in as seconds since the demo began). The script
writes here what the clients receive and what the proxy logs; the view reads it. Every
figure the demo shows is computed from these records, as a client of the proxy sees them:

- a **turn** is one streamed chat completion of a conversation. Its backend is the one that
  answered its head (``x-backend-id``; with ``retry_until_first_event`` the head of a retried
  request is held until the server that finally answers sends its first token), and each of
  its tokens names the backend that generated it (``system_fingerprint``: a continued answer
  carries the tokens of two backends in one stream);
- a turn is **complete** when it got status 200, the uninterrupted answer's text exactly and
  ``[DONE]``; anything else counts as failed;
- a follow-up turn **stayed** when it landed on the backend that finished the turn before it;
  a move is **forced** when that backend had been killed by then.
"""

from __future__ import annotations

import itertools
import json
from collections import deque
from collections.abc import Callable, Iterable

import attrs

from muxproxy.testing.fakellm import reply_text

EVENTS_KEPT = 200
"""Event log lines kept (the live view shows the last few, the summary counts them all)."""
RATE_WINDOW = 2.0
"""Seconds of tokens the live tokens/s figure averages over."""


def plural(count: int, noun: str) -> str:
    """``"1 token"``, ``"2 tokens"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def percentile(values: Iterable[float], q: float) -> float | None:
    """The nearest-rank ``q`` percentile (0 < q <= 100) of ``values``; None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


@attrs.define
class Turn:
    """One streamed chat completion of a conversation, as its client saw it."""

    conversation: str
    index: int
    """1 for the conversation's first turn."""
    protocol: str
    phase: str
    """The demo's phase when the request was sent."""
    tokens: int
    """Tokens asked for (``max_tokens``): the whole answer is ``reply_text(tokens)``."""
    sent_at: float
    status: int | None = None
    backend: str | None = None
    version: str | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    text: list[str] = attrs.Factory(list)
    producers: list[str] = attrs.Factory(list)
    """The backend of each token (its chunk's ``system_fingerprint``)."""
    token_times: list[float] = attrs.Factory(list)
    done: bool = False
    """``data: [DONE]`` arrived."""
    error: str | None = None
    retried_from: list[str] = attrs.Factory(list)
    """Backends it failed on before its first token, as the proxy logged them."""
    continued_from: list[str] = attrs.Factory(list)
    """Backends that died mid-answer, as the proxy logged them."""

    @property
    def request_id(self) -> str:
        return f"{self.conversation}.{self.index}"

    @property
    def running(self) -> bool:
        return self.finished_at is None

    @property
    def complete(self) -> bool:
        return (
            self.status == 200
            and self.done
            and self.error is None
            and "".join(self.text) == reply_text(self.tokens)
        )

    @property
    def final_backend(self) -> str | None:
        """The backend that generated its last token (else the one that answered)."""
        return self.producers[-1] if self.producers else self.backend

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    def on_data(self, data: str, now: float) -> None:
        """One SSE event's data."""
        if data == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        choices = chunk.get("choices") or [{}]
        content = choices[0].get("delta", {}).get("content")
        if not content:
            return
        if self.first_token_at is None:
            self.first_token_at = now
        self.text.append(content)
        self.token_times.append(now)
        self.producers.append(str(chunk.get("system_fingerprint") or self.backend or "?"))


@attrs.define
class Conversation:
    key: str
    """Its session key (the ``X-Chat-ID`` header)."""
    protocol: str
    turns: list[Turn] = attrs.Factory(list)
    ended: bool = False
    """Its last turn is over, and no other will come."""

    @property
    def first(self) -> Turn:
        return self.turns[0]

    @property
    def backend(self) -> str | None:
        """Where it is now: the backend that finished its latest finished turn."""
        for turn in reversed(self.turns):
            if not turn.running:
                return turn.final_backend
        return None


@attrs.define
class Backend:
    """One fake GPU backend, and what routing says of it (the admin API's ``/status``)."""

    name: str
    version: str
    address: str
    killed_at: float | None = None
    weight: int = 0
    state: str = "up"
    """``up``, ``draining`` or ``down``, as routing has it."""


@attrs.frozen(kw_only=True)
class BackendFigures:
    """One backend's row of the view and of the summary."""

    backend: Backend
    running: int
    conversations: int
    """Conversations going on whose latest turn it finished."""
    requests: int
    failed: int
    retried: int
    continued: int
    ttft_p50: float | None
    ttft_p99: float | None
    tokens: int
    tokens_per_second: float


@attrs.frozen(kw_only=True)
class PhaseFigures:
    """Where one phase's turns went: new conversations, and follow-ups of existing ones."""

    phase: str
    new: int
    new_by_version: dict[str, int]
    follow_ups: int
    stayed: int
    forced_moves: int


@attrs.frozen(kw_only=True)
class Stickiness:
    follow_ups: int
    stayed: int
    """Follow-up turns on the backend that finished the turn before."""
    forced_moves: int
    """The others whose backend had been killed."""

    @property
    def other_moves(self) -> int:
        """Follow-up turns that moved although their backend was up: none should."""
        return self.follow_ups - self.stayed - self.forced_moves

    @property
    def kept(self) -> float:
        """The share of follow-up turns that stayed, in percent."""
        return 100.0 * self.stayed / self.follow_ups if self.follow_ups else 100.0


@attrs.define
class Board:
    """Everything the demo has seen, and the figures computed from it."""

    backends: dict[str, Backend]
    phase: str = "starting"
    phases: list[str] = attrs.Factory(list)
    conversations: dict[str, Conversation] = attrs.Factory(dict)
    turns: list[Turn] = attrs.Factory(list)
    events: deque[tuple[float, str]] = attrs.Factory(lambda: deque(maxlen=EVENTS_KEPT))
    on_event: Callable[[float, str], None] | None = None
    """Called with each event as it is noted (the plain mode prints it)."""
    _by_request: dict[str, Turn] = attrs.Factory(dict)
    _by_address: dict[str, str] = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        self._by_address = {b.address: b.name for b in self.backends.values()}

    def note(self, now: float, text: str) -> None:
        """An event for the log."""
        self.events.append((now, text))
        if self.on_event is not None:
            self.on_event(now, text)

    def enter(self, now: float, phase: str) -> None:
        self.phase = phase
        self.phases.append(phase)
        self.note(now, f"phase: {phase}")

    def version_of(self, name: str | None) -> str | None:
        backend = self.backends.get(name or "")
        return None if backend is None else backend.version

    def backend_at(self, address: str) -> str:
        """The name of the backend at ``address`` (``host:port``), or the address."""
        return self._by_address.get(address, address)

    # -- turns ---------------------------------------------------------------------------

    def begin_turn(self, conversation: Conversation, tokens: int, now: float) -> Turn:
        turn = Turn(
            conversation=conversation.key,
            index=len(conversation.turns) + 1,
            protocol=conversation.protocol,
            phase=self.phase,
            tokens=tokens,
            sent_at=now,
        )
        conversation.turns.append(turn)
        self.conversations.setdefault(conversation.key, conversation)
        self.turns.append(turn)
        self._by_request[turn.request_id] = turn
        return turn

    def turn(self, request_id: str) -> Turn | None:
        return self._by_request.get(request_id)

    def end_turn(self, turn: Turn, now: float, error: str | None = None) -> None:
        turn.finished_at = now
        turn.error = error
        producers = dict.fromkeys(turn.producers)
        if turn.continued_from and turn.complete:
            parts = " + ".join(
                f"{plural(turn.producers.count(name), 'token')} from {name}" for name in producers
            )
            self.note(now, f"{turn.request_id}: one stream for the client: {parts}")
        elif not turn.complete:
            why = error or f"status {turn.status}, {len(turn.text)} of {turn.tokens} tokens"
            self.note(now, f"FAILED {turn.request_id} ({turn.protocol}): {why}")

    # -- figures -------------------------------------------------------------------------

    @property
    def finished(self) -> list[Turn]:
        return [t for t in self.turns if not t.running]

    @property
    def failed(self) -> list[Turn]:
        return [t for t in self.finished if not t.complete]

    def backend_figures(self, now: float) -> list[BackendFigures]:
        rows = []
        for name, backend in self.backends.items():
            answered = [t for t in self.turns if t.backend == name]
            finished = [t for t in answered if not t.running]
            ttfts = [t.ttft for t in answered if t.ttft is not None]
            tokens = sum(t.producers.count(name) for t in self.turns)
            rows.append(
                BackendFigures(
                    backend=backend,
                    # Where it streams from now: a continued answer moves.
                    running=sum(t.running and t.final_backend == name for t in self.turns),
                    conversations=sum(
                        not c.ended and c.backend == name for c in self.conversations.values()
                    ),
                    requests=len(finished),
                    failed=sum(not t.complete for t in finished),
                    retried=sum(t.retried_from.count(name) for t in self.turns),
                    continued=sum(t.continued_from.count(name) for t in self.turns),
                    ttft_p50=percentile(ttfts, 50),
                    ttft_p99=percentile(ttfts, 99),
                    tokens=tokens,
                    tokens_per_second=self._rate(name, now),
                )
            )
        return rows

    def _rate(self, name: str, now: float) -> float:
        """Tokens/s that ``name`` generated over the last ``RATE_WINDOW`` seconds."""
        since = now - RATE_WINDOW
        recent = sum(
            at > since and producer == name
            for turn in self.turns
            if turn.finished_at is None or turn.finished_at > since
            for producer, at in zip(turn.producers, turn.token_times, strict=True)
        )
        return recent / min(RATE_WINDOW, max(now, 1e-3))

    def follow_ups(self) -> list[tuple[Turn, Turn]]:
        """Every finished follow-up turn with the turn before it."""
        pairs = []
        for conversation in self.conversations.values():
            turns = conversation.turns
            for before, turn in itertools.pairwise(turns):
                if not turn.running and turn.backend is not None:
                    pairs.append((before, turn))
        return pairs

    def stayed(self, before: Turn, turn: Turn) -> bool:
        return turn.backend == before.final_backend

    def forced(self, before: Turn, turn: Turn) -> bool:
        """Whether the backend ``before`` ended on was killed before ``turn`` ended (so
        ``turn`` could not go there, or was retried away from it)."""
        backend = self.backends.get(before.final_backend or "")
        killed = None if backend is None else backend.killed_at
        ended = turn.finished_at
        return killed is not None and ended is not None and killed <= ended

    def stickiness(self) -> Stickiness:
        pairs = self.follow_ups()
        stayed = sum(self.stayed(b, t) for b, t in pairs)
        forced = sum(not self.stayed(b, t) and self.forced(b, t) for b, t in pairs)
        return Stickiness(follow_ups=len(pairs), stayed=stayed, forced_moves=forced)

    def phase_figures(self) -> list[PhaseFigures]:
        rows = []
        pairs = self.follow_ups()
        for phase in self.phases:
            firsts = [
                c.first
                for c in self.conversations.values()
                if c.first.phase == phase and c.first.backend is not None
            ]
            by_version: dict[str, int] = {}
            for turn in firsts:
                version = self.version_of(turn.backend) or "?"
                by_version[version] = by_version.get(version, 0) + 1
            mine = [(b, t) for b, t in pairs if t.phase == phase]
            rows.append(
                PhaseFigures(
                    phase=phase,
                    new=len(firsts),
                    new_by_version=by_version,
                    follow_ups=len(mine),
                    stayed=sum(self.stayed(b, t) for b, t in mine),
                    forced_moves=sum(not self.stayed(b, t) and self.forced(b, t) for b, t in mine),
                )
            )
        return rows
