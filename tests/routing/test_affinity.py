"""The session affinity memory (``muxproxy.routing.affinity``): bounded, expiring, hashed."""

from __future__ import annotations

from muxproxy.routing.affinity import Affinity, key_hash

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def test_a_key_goes_back_to_where_it_was_last_sent() -> None:
    memory = Affinity(idle=600.0)
    assert memory.lookup(b"conv-1", 0.0) is None
    memory.sent(b"conv-1", A, 0.0)
    memory.sent(b"conv-2", B, 1.0)
    assert memory.lookup(b"conv-1", 5.0) == A
    memory.sent(b"conv-1", B, 6.0)  # failed over, say: the last server counts
    assert memory.lookup(b"conv-1", 7.0) == B
    assert len(memory) == 2


def test_a_key_is_forgotten_after_idle_seconds_since_its_last_request() -> None:
    memory = Affinity(idle=10.0)
    memory.sent(b"k", A, 0.0)
    assert memory.lookup(b"k", 10.0) == A
    memory.sent(b"k", A, 10.0)  # each request renews it
    assert memory.lookup(b"k", 20.0) == A
    assert memory.lookup(b"k", 20.5) is None


def test_expired_keys_are_swept_by_later_requests() -> None:
    memory = Affinity(idle=10.0)
    for n in range(5):
        memory.sent(b"old-%d" % n, A, 0.0)
    memory.sent(b"new", B, 11.0)
    assert len(memory) == 1
    assert memory.lookup(b"new", 11.0) == B


def test_the_memory_is_bounded_and_drops_the_least_recently_sent_key() -> None:
    memory = Affinity(idle=600.0, limit=3)
    for n in range(3):
        memory.sent(b"k%d" % n, A, float(n))
    memory.sent(b"k0", B, 3.0)  # k0 is now the most recent, k1 the least
    memory.sent(b"k3", A, 4.0)
    assert len(memory) == 3
    assert memory.lookup(b"k1", 4.0) is None
    assert [memory.lookup(b"k%d" % n, 4.0) for n in (0, 2, 3)] == [B, A, A]
    for n in range(4, 1000):
        memory.sent(b"k%d" % n, A, 5.0)
    assert len(memory) == 3


def test_keys_are_kept_as_hashes_never_as_sent() -> None:
    memory = Affinity(idle=600.0)
    secret = b"user-4711-session-abcdef"
    memory.sent(secret, A, 0.0)
    (stored,) = memory._entries
    assert stored == key_hash(secret) and isinstance(stored, int)
    assert secret not in repr(memory._entries).encode()
    assert key_hash(secret) == key_hash(bytes(bytearray(secret)))  # equal keys alike
    assert key_hash(b"a") != key_hash(b"b")


def test_sweeping_expired_keys_stays_cheap_as_the_memory_empties() -> None:
    """Regression: with a plain dict as the LRU list, deleting from its front leaves dummy
    slots that every later ``next(iter(...))`` walks again, so a burst of new sessions after
    an idle spell cost O(n) each (250 µs a request at 100,000 keys, on the event loop).

    Measured as a ratio within one run, not against a clock: sweeping through 50,000 expired
    keys must cost about what the same number of fresh inserts costs, not hundreds of times
    more. The margin (20x) is far above noise and far below the bug (over 100x here)."""
    import time

    def insert(memory: Affinity, prefix: bytes, n: int, now: float) -> float:
        keys = [prefix + str(i).encode() for i in range(n)]
        start = time.perf_counter()
        for key in keys:
            memory.sent(key, A, now)
        return time.perf_counter() - start

    n = 50_000
    plain = insert(Affinity(idle=10.0, limit=4 * n), b"p", n, 0.0)
    memory = Affinity(idle=10.0, limit=4 * n)
    insert(memory, b"old", n, 0.0)
    sweeping = insert(memory, b"new", n, 100.0)  # every call sweeps expired keys
    assert len(memory) == n  # the old keys are gone (8 per call)
    assert sweeping < 20 * plain, (sweeping, plain)
