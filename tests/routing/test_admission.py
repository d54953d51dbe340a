"""The bounded fair queue (``muxproxy.routing.admission``): strict priority classes,
round-robin over tenants, FIFO per tenant, O(1) removal; checked against a list-based model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from muxproxy.routing.admission import FairQueue

A, B, C = 1, 2, 3


def drain(queue: FairQueue[str]) -> list[str]:
    popped = []
    while (item := queue.pop()) is not None:
        popped.append(item)
    return popped


def push_all(queue: FairQueue[str], tenant: int, count: int, priority: int = 0) -> list[str]:
    items = [f"{tenant}.{priority}.{n}" for n in range(count)]
    for item in items:
        assert queue.push(item, tenant, priority)
    return items


# -- fairness ----------------------------------------------------------------------------------


def test_a_tenant_behind_500_items_of_another_is_served_within_two_pops() -> None:
    queue: FairQueue[str] = FairQueue(1000)
    push_all(queue, A, 500)
    (b_item,) = push_all(queue, B, 1)
    assert queue.pop() == "1.0.0"  # at most one service slot of A before B
    assert queue.pop() == b_item
    assert queue.tenants() == 1 and len(queue) == 499
    assert drain(queue) == [f"1.0.{n}" for n in range(1, 500)]


def test_pop_first_takes_the_first_accepted_within_the_lookahead() -> None:
    queue: FairQueue[str] = FairQueue(100)
    push_all(queue, A, 3)  # 1.0.0 1.0.1 1.0.2
    push_all(queue, B, 2)  # 2.0.0 2.0.1
    # Scanned tenant by tenant in round order: A's three, then B's.
    assert queue.pop_first(lambda item: item.startswith("2."), lookahead=3) is None
    assert queue.pop_first(lambda item: item.startswith("2."), lookahead=4) == "2.0.0"
    # B was served: A keeps its turn, B goes to the back; the items passed over stay put.
    assert queue.pop_first(lambda item: item.endswith(".1"), lookahead=10) == "1.0.1"
    assert drain(queue) == ["2.0.1", "1.0.0", "1.0.2"]


def test_pop_first_looks_only_at_the_top_priority_class() -> None:
    queue: FairQueue[str] = FairQueue(100)
    push_all(queue, A, 1, priority=1)
    push_all(queue, B, 1, priority=0)
    assert queue.pop_first(lambda item: item.startswith("1."), lookahead=10) is None
    assert queue.pop_first(lambda item: True, lookahead=10) == "2.0.0"
    assert queue.pop_first(lambda item: True, lookahead=10) == "1.1.0"
    assert queue.pop_first(lambda item: True, lookahead=10) is None


def test_round_robin_over_three_tenants_with_uneven_counts() -> None:
    queue: FairQueue[str] = FairQueue(100)
    push_all(queue, A, 5)
    push_all(queue, B, 2)
    push_all(queue, C, 3)
    assert queue.tenants() == 3
    assert drain(queue) == [
        *("1.0.0", "2.0.0", "3.0.0"),
        *("1.0.1", "2.0.1", "3.0.1"),
        *("1.0.2", "3.0.2"),
        *("1.0.3", "1.0.4"),
    ]
    assert queue.tenants() == 0


def test_tenants_are_served_in_the_order_they_became_waiting() -> None:
    queue: FairQueue[str] = FairQueue(100)
    queue.push("c1", C)
    queue.push("a1", A)
    queue.push("c2", C)
    queue.push("b1", B)
    assert queue.pop() == "c1"  # C goes to the back: A, B, C
    queue.push("a2", A)
    assert drain(queue) == ["a1", "b1", "c2", "a2"]


def test_a_tenant_that_runs_dry_joins_at_the_back_when_it_returns() -> None:
    queue: FairQueue[str] = FairQueue(100)
    queue.push("a1", A)
    queue.push("b1", B)
    queue.push("b2", B)
    assert queue.pop() == "a1"  # A has nothing left: out of the round
    queue.push("a2", A)
    assert drain(queue) == ["b1", "a2", "b2"]


def test_priority_classes_are_strict_lower_first() -> None:
    queue: FairQueue[str] = FairQueue(100)
    push_all(queue, A, 3, priority=5)
    push_all(queue, B, 2, priority=0)
    push_all(queue, C, 2, priority=-1)
    assert queue.waiting() == 7
    assert [queue.waiting(p) for p in (-1, 0, 5, 7)] == [2, 2, 3, 0]
    assert queue.pop() == "3.-1.0"
    queue.push("late", A, priority=0)  # A in class 0 too, behind B
    assert drain(queue) == ["3.-1.1", "2.0.0", "late", "2.0.1", "1.5.0", "1.5.1", "1.5.2"]


def test_round_robin_is_per_class() -> None:
    queue: FairQueue[str] = FairQueue(100)
    push_all(queue, A, 2, priority=1)
    push_all(queue, B, 2, priority=1)
    push_all(queue, A, 2, priority=0)
    assert queue.tenants() == 2
    assert drain(queue) == ["1.0.0", "1.0.1", "1.1.0", "2.1.0", "1.1.1", "2.1.1"]


# -- bounds, peek, remove ----------------------------------------------------------------------


def test_push_says_false_when_full() -> None:
    queue: FairQueue[str] = FairQueue(2)
    assert queue.push("a", A) and queue.push("b", B)
    assert not queue.push("c", C, priority=-9)
    assert "c" not in queue and len(queue) == 2 and queue.tenants() == 2
    assert queue.pop() == "a"
    assert queue.push("c", C)
    assert not FairQueue[str](0).push("x", A)
    with pytest.raises(ValueError, match="limit must be at least 0"):
        FairQueue[str](-1)


def test_peek_shows_the_next_pop_and_changes_nothing() -> None:
    queue: FairQueue[str] = FairQueue(100)
    assert queue.peek() is None and queue.pop() is None
    push_all(queue, A, 2)
    push_all(queue, B, 1)
    seen = []
    while queue:
        peeked = queue.peek()
        assert queue.peek() == peeked
        seen.append(peeked)
        assert queue.pop() == peeked
    assert seen == ["1.0.0", "2.0.0", "1.0.1"]


def test_remove_from_front_middle_and_back_keeps_the_order() -> None:
    queue: FairQueue[str] = FairQueue(100)
    a = push_all(queue, A, 5)
    b = push_all(queue, B, 2)
    assert queue.remove(a[0]) and queue.remove(a[2]) and queue.remove(a[4])
    assert not queue.remove(a[2])  # not queued any more
    assert not queue.remove("never queued")
    assert a[2] not in queue and a[1] in queue
    assert len(queue) == 4 and queue.waiting(0) == 4
    assert drain(queue) == [a[1], b[0], a[3], b[1]]


def test_removing_a_tenants_last_item_takes_it_out_of_the_round() -> None:
    queue: FairQueue[str] = FairQueue(100)
    queue.push("a1", A)
    queue.push("b1", B)
    queue.push("c1", C)
    assert queue.remove("a1")
    assert queue.tenants() == 2
    queue.push("a2", A)  # back, at the back
    assert queue.peek() == "b1"
    assert drain(queue) == ["b1", "c1", "a2"]


def test_items_are_told_apart_by_identity_and_need_not_be_hashable() -> None:
    queue: FairQueue[list[int]] = FairQueue(100)
    first: list[int] = []
    second: list[int] = []  # equal to first, and unhashable
    assert queue.push(first, A) and queue.push(second, A)
    assert [] not in queue  # a third equal list is not queued
    assert queue.remove(second)
    assert first in queue and second not in queue
    with pytest.raises(ValueError, match="queued already"):
        queue.push(first, B)  # one item, one place
    assert queue.pop() is first
    assert queue.push(first, B)  # popped: it may come back


def test_many_priorities_coming_and_going_keep_the_heap_small() -> None:
    queue: FairQueue[object] = FairQueue(100)
    queue.push(object(), A, priority=-1)  # keeps the stale entries from the top
    for priority in range(10_000):
        item = object()
        queue.push(item, B, priority)
        queue.remove(item)
    assert len(queue._heap) <= 2 * 1 + 8 + 1
    assert queue.waiting() == 1


# -- against a model ---------------------------------------------------------------------------


class Item:
    """A queued thing; equal items are still distinct entries."""

    __slots__ = ("name",)

    def __init__(self, name: int) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return True  # deliberately: the queue must use identity

    __hash__ = None  # type: ignore[assignment]  # deliberately unhashable

    def __repr__(self) -> str:
        return f"Item({self.name})"


class ListModel:
    """The order of service written plainly: items in push order, and per class a list of
    the tenants with items waiting in the order they are due."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.items: list[tuple[Item, int, int]] = []  # (item, tenant, priority)
        self.rotation: dict[int, list[int]] = {}

    def _has(self, tenant: int, priority: int) -> bool:
        return any(t == tenant and p == priority for _, t, p in self.items)

    def push(self, item: Item, tenant: int, priority: int) -> bool:
        if len(self.items) == self.limit:
            return False
        if not self._has(tenant, priority):
            self.rotation.setdefault(priority, []).append(tenant)
        self.items.append((item, tenant, priority))
        return True

    def next(self) -> tuple[Item, int, int] | None:
        if not self.items:
            return None
        priority = min(p for _, _, p in self.items)
        tenant = self.rotation[priority][0]
        return next(e for e in self.items if e[1] == tenant and e[2] == priority)

    def pop(self) -> Item | None:
        entry = self.next()
        if entry is None:
            return None
        item, tenant, priority = entry
        self._take(item)
        self.rotation[priority].remove(tenant)
        if self._has(tenant, priority):
            self.rotation[priority].append(tenant)
        return item

    def remove(self, item: Item) -> bool:
        entry = next((e for e in self.items if e[0] is item), None)
        if entry is None:
            return False
        self._take(item)
        if not self._has(entry[1], entry[2]):
            self.rotation[entry[2]].remove(entry[1])
        return True

    def pop_first(self, accept: set[int], lookahead: int) -> Item | None:
        """The first of the next ``lookahead`` items of the top class, tenant by tenant in
        round order, whose name is in ``accept``; taken out as ``pop`` takes its item."""
        if not self.items:
            return None
        priority = min(p for _, _, p in self.items)
        order = [
            entry
            for tenant in self.rotation[priority]
            for entry in self.items
            if entry[1] == tenant and entry[2] == priority
        ][:lookahead]
        entry = next((e for e in order if e[0].name in accept), None)
        if entry is None:
            return None
        item, tenant, _ = entry
        self._take(item)
        self.rotation[priority].remove(tenant)
        if self._has(tenant, priority):
            self.rotation[priority].append(tenant)
        return item

    def _take(self, item: Item) -> None:
        self.items = [e for e in self.items if e[0] is not item]


class FairQueueAgainstModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.queue: FairQueue[Item] = FairQueue(12)
        self.model = ListModel(12)
        self.made: list[Item] = []

    @rule(tenant=st.integers(0, 2), priority=st.integers(-1, 1))
    def push(self, tenant: int, priority: int) -> None:
        item = Item(len(self.made))
        self.made.append(item)
        assert self.queue.push(item, tenant, priority) == self.model.push(item, tenant, priority)

    @rule()
    def pop(self) -> None:
        assert self.queue.pop() is self.model.pop()

    @rule(accept=st.sets(st.integers(0, 40), max_size=6), lookahead=st.integers(1, 6))
    def pop_first(self, accept: set[int], lookahead: int) -> None:
        found = self.queue.pop_first(lambda item: item.name in accept, lookahead)
        assert found is self.model.pop_first(accept, lookahead)

    @rule()
    def peek(self) -> None:
        entry = self.model.next()
        assert self.queue.peek() is (None if entry is None else entry[0])

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        if not self.made:
            return
        item = data.draw(st.sampled_from(self.made))  # queued, popped or removed already
        assert self.queue.remove(item) == self.model.remove(item)

    @invariant()
    def counts_agree(self) -> None:
        items = self.model.items
        assert len(self.queue) == len(items)
        for priority in range(-1, 2):
            assert self.queue.waiting(priority) == sum(1 for e in items if e[2] == priority)
        assert self.queue.tenants() == len({tenant for _, tenant, _ in items})
        queued = {id(item) for item, _, _ in items}
        assert all((item in self.queue) == (id(item) in queued) for item in self.made)


FairQueueAgainstModel.TestCase.settings = settings(
    max_examples=200, stateful_step_count=60, deadline=None
)
test_fair_queue_agrees_with_the_list_model = FairQueueAgainstModel.TestCase
