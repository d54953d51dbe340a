"""An exchange's phases as data: what drives it, and what each input may do in each phase.

``Exchange`` (``exchange.py``) is in one ``ports.Phase`` at a time. What can reach it is named
in ``ExchangeInput``, of two kinds, and ``TRANSITIONS`` lists every (phase, input) pair
(``states.py``: the tests check that the table is total):

- **Events**: what the client side, the backend stream and the timers hand the exchange
  (``ports.ClientStream``, ``ports.UpstreamUser``, ``ExchangeTimer``). An event's pair says
  whether the exchange takes it in that phase: its own phase (taken: the handler runs, and
  any change of phase it makes is a move of its own), ``IGNORED`` or ``ILLEGAL``. An event
  never changes the phase by itself, because what it leads to depends on what it carries (a
  response head is retried, held or relayed); so a taken event keeps its phase, the "acted on
  and changes nothing" case of ``states.py``, and an ignored one is one not acted on at all.
- **Moves**: the exchange's own decisions (route, retry, send the head, end). A move's pair
  names the phase it leads to, or is ``ILLEGAL``; a move is never ignored.

Rules the table encodes:

- Nothing is retried once a response byte went out: ``RETRY``, ``FAIL`` (our own error
  answer), ``HOLD`` and ``COMMIT`` are illegal from STREAMING (RFC 9110 §9.2.2: the proxy
  decides whether to retry, and only while nothing reached the client).
- A backend event comes only while a backend stream is attached (WAITING_HEAD, HOLDING,
  STREAMING; a failure or a stream also while CONNECTING), and in the order HTTP gives it:
  one head, then body, then the end. Anything else is a bug in the pool or an adapter: h11
  and h2 drop 1xx heads, and a stream detached from its exchange delivers nothing more.
- A timer fires only in the phases it is armed in: each is cancelled when its phase ends
  (``deadlines.ATTEMPT_TIMERS`` on a retry and at the end), and ``Effects.fired`` drops the
  wakeup of a cancelled timer. The lazy ``body`` timer is not cancelled when the response
  begins; it is ignored from then on (the backend is answering: a slow body is no longer the
  client's fault to judge).
- DONE is inert: every event is ignored, whatever stale reference delivers it (fault
  isolation makes a dropped exchange DONE, ``faults.py``); an offered backend stream is
  closed and request body credit given back, since neither is taken. Every move from DONE is
  illegal: an exchange ends once.

Both enums hash by identity, so a lookup runs no Python code; still, the per-token path
(``response_body`` while STREAMING, and the flow's ``client_drained`` and the like) is checked
with an ``is`` before any lookup.
"""

from __future__ import annotations

import enum

from muxproxy.core.ports import Phase
from muxproxy.core.states import IGNORED, ILLEGAL, Transitions, Verdict
from muxproxy.core.timers import ExchangeTimer


class ExchangeInput(enum.Enum):
    __hash__ = object.__hash__  # as ``Phase``'s: a lookup runs no Python code
    # -- events from the backend stream (``ports.UpstreamUser``) ----------------------------
    UPSTREAM_READY = "upstream_ready"
    """The pool hands the exchange the backend stream it asked for."""
    UPSTREAM_DRAINED = "upstream_drained"
    """The backend stream wrote some of the request bytes it held."""
    RESPONSE_HEAD = "response_head"
    RESPONSE_BODY = "response_body"
    RESPONSE_END = "response_end"
    UPSTREAM_FAILED = "upstream_failed"
    """The backend stream broke, could not be opened, or one of its timers ran out."""
    # -- events from the client side (``ports.ClientStream``) -------------------------------
    REQUEST_BODY = "request_body"
    REQUEST_END = "request_end"
    CLIENT_ABORTED = "client_aborted"
    CLIENT_STALLED = "client_stalled"
    """The client connection is above ``connection_buffer``: stop the backend."""
    CLIENT_DRAINED = "client_drained"
    """The client connection that holds this stream wrote some of its output."""
    # -- from the group's admission queue (``ProxyCore._admit_waiting``) ----------------------
    ADMITTED = "admitted"
    """A server has room: the queue hands the exchange its turn."""
    # -- from the fleet store (``fleetadmit.py``) ----------------------------------------------
    RESERVED = "reserved"
    """The store answered the budget reservation (or failed to)."""
    # -- from an extension's async hook (``hooked.py``) ----------------------------------------
    HOOK_ANSWERED = "hook_answered"
    """The driver's answer of an async request-head hook (or its failure)."""
    # -- timers (``ExchangeTimer``) ----------------------------------------------------------
    CONNECT_TIMER = "connect_timer"
    HEAD_TIMER = "head_timer"
    FIRST_TOKEN_TIMER = "first_token_timer"
    READ_TIMER = "read_timer"
    HEARTBEAT_TIMER = "heartbeat_timer"
    DEADLINE_TIMER = "deadline_timer"
    BODY_TIMER = "body_timer"
    TUNNEL_TIMER = "tunnel_timer"
    """A tunnel's (``websocket.py`` hands it to the tunnel once one is open)."""
    QUEUE_TIMER = "queue_timer"
    """The wait in the admission queue ran out."""
    # -- moves: the exchange's own decisions ---------------------------------------------------
    BUFFER = "buffer"
    """The session key is in the request body: hold its start before routing."""
    RESERVE = "reserve"
    """The budgets are the fleet's: wait for the store's answer to the reservation."""
    AWAIT_HOOK = "await_hook"
    """An extension's async request-head hook runs: wait for its answer."""
    HOOKED = "hooked"
    """The async hook answered and let the request go on: routing continues."""
    QUEUE = "queue"
    """Every candidate server is full: wait in the group's admission queue."""
    ATTEMPT = "attempt"
    """The first server is chosen; its stream is asked for (also when the queue admits)."""
    RETRY = "retry"
    """The attempt failed before anything reached the client: another server (or a fresh
    connection to the same one) is asked for."""
    REQUEST_SENT = "request_sent"
    """The request head went to the backend stream."""
    HOLD = "hold"
    """An SSE head is held until its first event (``retry_until_first_event``)."""
    COMMIT = "commit"
    """The response head goes to the client: nothing is retried from here on."""
    FAIL = "fail"
    """An error answer of our own (``heads.py``), while no response head went out."""
    REPLAY = "replay"
    """A resume (``replay.py``): the response comes from the kept events of a stream, not
    from a backend of this exchange's own; its head goes out at once."""
    FINISH = "finish"
    """The exchange ends (a complete response, a truncated one, an abort)."""


TIMER_INPUTS: dict[ExchangeTimer, ExchangeInput] = {
    ExchangeTimer.CONNECT: ExchangeInput.CONNECT_TIMER,
    ExchangeTimer.HEAD: ExchangeInput.HEAD_TIMER,
    ExchangeTimer.FIRST_TOKEN: ExchangeInput.FIRST_TOKEN_TIMER,
    ExchangeTimer.READ: ExchangeInput.READ_TIMER,
    ExchangeTimer.HEARTBEAT: ExchangeInput.HEARTBEAT_TIMER,
    ExchangeTimer.DEADLINE: ExchangeInput.DEADLINE_TIMER,
    ExchangeTimer.BODY: ExchangeInput.BODY_TIMER,
    ExchangeTimer.TUNNEL: ExchangeInput.TUNNEL_TIMER,
    ExchangeTimer.QUEUE: ExchangeInput.QUEUE_TIMER,
}
"""The input each of an exchange's timers is."""

_A, _B, _R, _Q, _C, _W, _H, _S, _D = (
    Phase.AWAITING_HOOK,
    Phase.BUFFERING,
    Phase.RESERVING,
    Phase.QUEUED,
    Phase.CONNECTING,
    Phase.WAITING_HEAD,
    Phase.HOLDING,
    Phase.STREAMING,
    Phase.DONE,
)
_I = ExchangeInput
_X = ILLEGAL
# One row per input: its targets in AWAITING_HOOK, BUFFERING, RESERVING, QUEUED, CONNECTING,
# WAITING_HEAD, HOLDING, STREAMING, DONE. A live phase's own name: the event is taken there.
# AWAITING_HOOK, RESERVING and QUEUED have no backend stream and no pool request: only the
# client side, its body timer, the gRPC deadline and their own input (the hook's answer, the
# store's answer, the queue's timer) reach them.
_ROWS: dict[ExchangeInput, tuple[Phase | Verdict, ...]] = {
    # A stream is asked for in CONNECTING only; the pool forgets who stopped waiting.
    _I.UPSTREAM_READY: (_X, _X, _X, _X, _C, _X, _X, _X, IGNORED),
    _I.UPSTREAM_DRAINED: (_X, _X, _X, _X, _X, _W, _H, _S, IGNORED),
    _I.RESPONSE_HEAD: (_X, _X, _X, _X, _X, _W, _X, _X, IGNORED),
    # HOLDING: the first event commits the held head.
    _I.RESPONSE_BODY: (_X, _X, _X, _X, _X, _X, _H, _S, IGNORED),
    _I.RESPONSE_END: (_X, _X, _X, _X, _X, _X, _H, _S, IGNORED),
    # CONNECTING: a connect failed (or a shared connection had no stream for us).
    _I.UPSTREAM_FAILED: (_X, _X, _X, _X, _C, _W, _H, _S, IGNORED),
    _I.REQUEST_BODY: (_A, _B, _R, _Q, _C, _W, _H, _S, IGNORED),
    _I.REQUEST_END: (_A, _B, _R, _Q, _C, _W, _H, _S, IGNORED),
    _I.CLIENT_ABORTED: (_A, _B, _R, _Q, _C, _W, _H, _S, IGNORED),
    # The client connection asks every exchange it carries; one without a backend has
    # nothing to stop.
    _I.CLIENT_STALLED: (IGNORED, IGNORED, IGNORED, IGNORED, IGNORED, _W, _H, _S, IGNORED),
    # A connection holds only an exchange whose backend it stopped, until that is released.
    _I.CLIENT_DRAINED: (_X, _X, _X, _X, _X, _W, _H, _S, IGNORED),
    # The store's answer comes to an exchange that waits for it; DONE: it ended meanwhile
    # (``fleetadmit.py`` gives back what the store reserved).
    _I.RESERVED: (_X, _X, _R, _X, _X, _X, _X, _X, IGNORED),
    # The queue holds only exchanges that wait (leaving the phase leaves the queue); DONE:
    # one that fault isolation ended while it waited.
    _I.ADMITTED: (_X, _X, _X, _Q, _X, _X, _X, _X, IGNORED),
    _I.CONNECT_TIMER: (_X, _X, _X, _X, _C, _X, _X, _X, IGNORED),
    _I.HEAD_TIMER: (_X, _X, _X, _X, _X, _W, _X, _X, IGNORED),
    # Armed with the request head, cancelled by the first body byte.
    _I.FIRST_TOKEN_TIMER: (_X, _X, _X, _X, _X, _W, _H, _S, IGNORED),
    # Armed when the head is held or relayed.
    _I.READ_TIMER: (_X, _X, _X, _X, _X, _X, _H, _S, IGNORED),
    _I.HEARTBEAT_TIMER: (_X, _X, _X, _X, _X, _X, _X, _S, IGNORED),
    # The gRPC call's deadline, from the start to the end.
    _I.DEADLINE_TIMER: (_A, _B, _R, _Q, _C, _W, _H, _S, IGNORED),
    _I.BODY_TIMER: (_A, _B, _R, _Q, _C, _W, IGNORED, IGNORED, IGNORED),
    _I.TUNNEL_TIMER: (_X, _X, _X, _X, _X, _X, _X, _X, IGNORED),
    _I.HOOK_ANSWERED: (_A, _X, _X, _X, _X, _X, _X, _X, IGNORED),
    # Armed on entering QUEUED, cancelled on leaving it.
    _I.QUEUE_TIMER: (_X, _X, _X, _Q, _X, _X, _X, _X, IGNORED),
    # Moves.
    _I.BUFFER: (
        _X,
        _X,
        _X,
        _X,
        _B,
        _X,
        _X,
        _X,
        _X,
    ),  # from ``start`` (an exchange begins CONNECTING)
    # Routed, and the budgets are the fleet store's.
    _I.RESERVE: (_X, _R, _X, _X, _R, _X, _X, _X, _X),
    # From ``start`` (an exchange begins CONNECTING), after the route is found (BUFFERING:
    # found by the body's model, ``bymodel.py``); back.
    _I.AWAIT_HOOK: (_X, _A, _X, _X, _A, _X, _X, _X, _X),
    _I.HOOKED: (_C, _X, _X, _X, _X, _X, _X, _X, _X),
    _I.QUEUE: (_X, _Q, _Q, _X, _Q, _X, _X, _X, _X),  # routed, and no candidate has room
    # Routed from the head or from the buffered body, or admitted from the queue.
    _I.ATTEMPT: (_X, _C, _C, _C, _C, _X, _X, _X, _X),
    _I.RETRY: (_X, _X, _X, _X, _C, _C, _C, _X, _X),
    _I.REQUEST_SENT: (_X, _X, _X, _X, _W, _X, _X, _X, _X),
    _I.HOLD: (_X, _X, _X, _X, _X, _H, _X, _X, _X),
    _I.COMMIT: (_X, _X, _X, _X, _X, _S, _S, _X, _X),
    _I.FAIL: (_D, _D, _D, _D, _D, _D, _D, _X, _X),
    # From ``start``, before any routing; or once the body's model chose the route.
    _I.REPLAY: (_X, _S, _X, _X, _S, _X, _X, _X, _X),
    _I.FINISH: (_D, _D, _D, _D, _D, _D, _D, _D, _X),
}
_PHASES = (_A, _B, _R, _Q, _C, _W, _H, _S, _D)

TRANSITIONS: Transitions[Phase, ExchangeInput] = {
    (phase, input): target
    for input, row in _ROWS.items()
    for phase, target in zip(_PHASES, row, strict=True)
}
"""(phase, input) -> the next phase, ``IGNORED`` or ``ILLEGAL`` (see the module)."""

EVENTS = frozenset(_I) - {
    _I.BUFFER,
    _I.RESERVE,
    _I.QUEUE,
    _I.ATTEMPT,
    _I.RETRY,
    _I.REQUEST_SENT,
    _I.HOLD,
    _I.COMMIT,
    _I.FAIL,
    _I.AWAIT_HOOK,
    _I.HOOKED,
    _I.REPLAY,
    _I.FINISH,
}
"""The inputs that are events (the others are moves)."""

del _A, _B, _R, _Q, _C, _W, _H, _S, _D, _I, _X
