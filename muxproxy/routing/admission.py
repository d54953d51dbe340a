"""The bounded, fair queue of requests waiting for a server with room.

Obeys the routing rules: pure code, standard library only, no clock, no randomness, no I/O.
Why it exists: when every server is full, requests wait in the proxy rather than in an
engine, and the order they leave in decides who waits. First come, first served would let
one tenant that sends 500 requests at once make everyone behind them wait for all 500.

Order of service (what ``pop`` returns):

1. Strictly by priority class, lower value first, as vLLM's ``priority`` field orders its
   own queue ("lower values mean earlier handling"); any int, negative too.
2. Within a class, round-robin over its tenants: each tenant with items waiting is served
   once per round, in the order the tenants became waiting (a tenant served goes to the back;
   one that had nothing waiting joins at the back). One item per turn, whatever its size:
   deficit round-robin with a quantum of one request.
3. Within a tenant and class, first in, first out.

So a tenant that becomes waiting behind another one's 500 items is served at its first turn,
after at most one item of each tenant ahead of it in the round.

``pop_first(accept, lookahead)`` bends the order for locality, boundedly: among the first
``lookahead`` items of the top class, taken tenant by tenant in round order and FIFO within
each, it returns the first that ``accept`` takes (the caller's test: a request whose own
server has room, or that waited long enough), and None if none does; the caller then
``pop``s. The items it passes over keep their places, and their tenants their turns.

Invariants:

- Bounded: at most ``limit`` items; ``push`` says False rather than grow past it.
- Every operation is O(1) (``pop`` and ``peek`` O(log p) over the p priority classes in
  use): tenants and items live in ``OrderedDict``s, so ``remove`` (a client that left) takes
  an item out of the middle without leaving anything behind, and the rotation's first tenant
  is found in O(1) however many were deleted before it, unlike a plain dict's. The heap of
  priorities drops classes that emptied lazily and is rebuilt when most of it is stale.
- Items are told apart by identity (``id``), never by ``==`` or ``hash()``: they need not
  be hashable, and two equal items are two entries. The queue holds each item it indexes,
  so no other live object can have the same id while it waits.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["FairQueue"]

T = TypeVar("T")


class _Class(Generic[T]):
    """One priority class: its tenants in rotation order, each with its items in FIFO order
    (keyed by the item's id)."""

    __slots__ = ("count", "rotation")

    def __init__(self) -> None:
        self.rotation: OrderedDict[int, OrderedDict[int, T]] = OrderedDict()
        self.count = 0


class FairQueue(Generic[T]):
    """Items waiting by priority class, round-robin over tenants, FIFO per tenant."""

    __slots__ = ("_classes", "_heap", "_index", "_per_tenant", "limit")

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit must be at least 0, not {limit!r}")
        self.limit = limit
        """Items held at most."""
        self._index: dict[int, tuple[T, int, int]] = {}  # id -> (item, priority, tenant)
        self._classes: dict[int, _Class[T]] = {}
        self._heap: list[int] = []  # the priorities of _classes, and some stale ones
        self._per_tenant: dict[int, int] = {}  # tenant -> items waiting, all classes

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, item: object) -> bool:
        return id(item) in self._index

    def waiting(self, priority: int | None = None) -> int:
        """Items waiting, in all classes or in one."""
        if priority is None:
            return len(self._index)
        found = self._classes.get(priority)
        return 0 if found is None else found.count

    def tenants(self) -> int:
        """Tenants with items waiting (in any class)."""
        return len(self._per_tenant)

    def push(self, item: T, tenant: int, priority: int = 0) -> bool:
        """Queue ``item`` for ``tenant``; False (and nothing queued) when ``limit`` items
        wait already. Raises ValueError if ``item`` itself is queued already (a caller's
        bug: one item, one place)."""
        key = id(item)
        if key in self._index:
            raise ValueError("the item is queued already")
        if len(self._index) >= self.limit:
            return False
        found = self._classes.get(priority)
        if found is None:
            found = self._classes[priority] = _Class()
            heapq.heappush(self._heap, priority)
            if len(self._heap) > 2 * len(self._classes) + 8:
                self._heap = list(self._classes)
                heapq.heapify(self._heap)
        items = found.rotation.get(tenant)
        if items is None:
            items = found.rotation[tenant] = OrderedDict()  # joins at the back of the round
        items[key] = item
        found.count += 1
        self._index[key] = (item, priority, tenant)
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        return True

    def peek(self) -> T | None:
        """The item ``pop`` would return, left in place; None if nothing waits."""
        found = self._first()
        if found is None:
            return None
        items = next(iter(found.rotation.values()))
        return next(iter(items.values()))

    def pop(self) -> T | None:
        """The next item in order of service (see the module), taken out; None if empty."""
        found = self._first()
        if found is None:
            return None
        tenant, items = next(iter(found.rotation.items()))
        key, item = items.popitem(last=False)
        if items:
            found.rotation.move_to_end(tenant)  # served: to the back of the round
        else:
            del found.rotation[tenant]
        self._forget(key, found, tenant)
        return item

    def pop_first(self, accept: Callable[[T], bool], lookahead: int) -> T | None:
        """The first of the next ``lookahead`` items of the top class (see the module) that
        ``accept`` takes, taken out, its tenant served; None if none of them is taken."""
        found = self._first()
        if found is None:
            return None
        seen = 0
        for tenant, items in found.rotation.items():
            for key, item in items.items():
                if accept(item):
                    del items[key]
                    if items:
                        found.rotation.move_to_end(tenant)
                    else:
                        del found.rotation[tenant]
                    self._forget(key, found, tenant)
                    return item
                seen += 1
                if seen >= lookahead:
                    return None
        return None

    def remove(self, item: T) -> bool:
        """Take ``item`` out wherever it waits (its client left); False if it is not queued."""
        key = id(item)
        entry = self._index.get(key)
        if entry is None:
            return False
        _, priority, tenant = entry
        found = self._classes[priority]
        items = found.rotation[tenant]
        del items[key]
        if not items:
            del found.rotation[tenant]  # a later push joins at the back
        self._forget(key, found, tenant)
        return True

    def _first(self) -> _Class[T] | None:
        """The class of the lowest priority with items waiting."""
        heap = self._heap
        classes = self._classes
        while heap:
            found = classes.get(heap[0])
            if found is not None:
                return found
            heapq.heappop(heap)  # a class that emptied since
        return None

    def _forget(self, key: int, found: _Class[T], tenant: int) -> None:
        _, priority, _ = self._index.pop(key)
        found.count -= 1
        if found.count == 0:
            del self._classes[priority]  # its heap entry goes lazily
        left = self._per_tenant[tenant] - 1
        if left:
            self._per_tenant[tenant] = left
        else:
            del self._per_tenant[tenant]
