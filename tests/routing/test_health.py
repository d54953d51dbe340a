"""Passive (max_fails/fail_timeout) and active (probe thresholds) health, usable servers."""

from __future__ import annotations

from muxproxy.config import HealthCheck, Server
from muxproxy.routing.health import ActiveHealth, PassiveHealth, usable_servers

S3 = Server(address="10.0.0.1:8000", max_fails=3, fail_timeout=10.0)
S1 = Server(address="10.0.0.2:8000")  # max_fails=1, fail_timeout=10


# -- passive -----------------------------------------------------------------------------------


def test_max_fails_within_fail_timeout_takes_a_server_out() -> None:
    health = PassiveHealth(2)
    assert health.usable(0, 0.0)
    assert not health.failure(0, 100.0, S3)
    assert not health.failure(0, 105.0, S3)
    assert health.usable(0, 105.0)
    assert health.failure(0, 110.0, S3)  # the third within 10 s of the first
    assert not health.usable(0, 110.0)
    assert not health.usable(0, 119.9)
    assert health.usable(0, 120.0)  # out for fail_timeout seconds, then tried again
    assert health.out_until(0) == 120.0
    assert health.usable(1, 110.0)  # other servers are not affected
    assert health.out_until(1) is None


def test_failures_spread_wider_than_fail_timeout_do_not() -> None:
    health = PassiveHealth(1)
    # The window starts at the first failure: 0 and 8 count two, 16 starts a new window.
    for now in (0.0, 8.0, 16.0, 24.0, 32.0, 40.0):
        assert not health.failure(0, now, S3)
        assert health.usable(0, now)
    assert health.failure(0, 41.0, S3)  # the third within 10 s of 32


def test_max_fails_one() -> None:
    health = PassiveHealth(1)
    assert health.failure(0, 5.0, S1)
    assert not health.usable(0, 14.0)
    assert health.usable(0, 15.0)


def test_max_fails_zero_never_takes_a_server_out() -> None:
    health = PassiveHealth(1)
    server = Server(address="10.0.0.3:8000", max_fails=0)
    assert not any(health.failure(0, float(t), server) for t in range(100))
    assert health.usable(0, 100.0)


def test_success_resets_the_count() -> None:
    health = PassiveHealth(1)
    health.failure(0, 0.0, S3)
    health.failure(0, 1.0, S3)
    health.success(0)
    assert not health.failure(0, 2.0, S3)
    assert not health.failure(0, 3.0, S3)
    assert health.failure(0, 4.0, S3)


def test_after_coming_back_one_failure_takes_it_out_again() -> None:
    """As in nginx: the count is only reset by a success, so the trial request decides."""
    health = PassiveHealth(1)
    for now in (0.0, 1.0, 2.0):
        health.failure(0, now, S3)
    assert not health.usable(0, 11.0)
    assert health.usable(0, 12.0)
    assert health.failure(0, 12.5, S3)  # the trial failed
    assert not health.usable(0, 22.0)
    assert health.usable(0, 22.5)
    health.success(0)  # the next trial worked: a clean slate
    assert not health.failure(0, 23.0, S3)
    assert health.usable(0, 23.0)


def test_failures_while_out_change_nothing() -> None:
    health = PassiveHealth(1)
    assert health.failure(0, 0.0, S1)
    assert not health.failure(0, 5.0, S1)  # an in-flight request failing late
    assert health.usable(0, 10.0)  # not extended to 15


def test_success_while_out_keeps_it_out_but_clears_probation() -> None:
    health = PassiveHealth(1)
    for now in (0.0, 1.0, 2.0):
        health.failure(0, now, S3)
    health.success(0)
    assert not health.usable(0, 5.0)
    assert health.usable(0, 12.0)
    assert not health.failure(0, 12.0, S3)  # counted afresh, not on probation


# -- active ------------------------------------------------------------------------------------


def test_active_thresholds() -> None:
    health = ActiveHealth(2, HealthCheck(fails=2, passes=3))
    assert health.up(0) and health.up(1)
    assert not health.result(0, False)
    assert health.up(0)
    assert health.result(0, False)  # second consecutive failure: down
    assert not health.up(0)
    assert health.up(1)
    assert not health.result(0, True)
    assert not health.result(0, True)
    assert not health.up(0)
    assert health.result(0, True)  # third consecutive pass: up
    assert health.up(0)


def test_active_streaks_must_be_consecutive() -> None:
    health = ActiveHealth(1, HealthCheck(fails=2, passes=2))
    for ok in (False, True, False, True, False, True):
        assert not health.result(0, ok)
    assert health.up(0)
    assert not health.result(0, False)
    assert health.result(0, False)
    for ok in (True, False, True, False):
        assert not health.result(0, ok)
    assert not health.up(0)
    assert not health.result(0, True)
    assert health.result(0, True)
    assert health.up(0)


def test_active_passes_while_up_and_fails_while_down_change_nothing() -> None:
    health = ActiveHealth(1, HealthCheck(fails=1, passes=1))
    assert not health.result(0, True)
    assert health.result(0, False)
    assert not health.result(0, False)
    assert not health.up(0)
    assert health.result(0, True)
    assert health.up(0)


def test_new_thresholds_keep_the_state_and_the_streak() -> None:
    health = ActiveHealth(1, HealthCheck(fails=3, passes=3))
    assert not health.result(0, False)
    health.set_thresholds(HealthCheck(fails=2, passes=1))
    assert health.up(0)
    assert health.result(0, False)  # the streak of one went on: two of the new two
    assert not health.up(0)
    assert health.result(0, True)  # one pass is enough now
    assert health.up(0)


# -- usable servers ----------------------------------------------------------------------------


def group(*backup: bool) -> list[Server]:
    return [Server(address=f"10.0.0.{i}:8000", backup=b) for i, b in enumerate(backup, 1)]


def test_usable_all_primaries() -> None:
    servers = group(False, False, True)
    passive = PassiveHealth(3)
    assert usable_servers(servers, [1, 1, 1], passive, None, 0.0, for_new_sessions=True) == [0, 1]


def test_usable_excludes_passively_failed_until_their_timeout() -> None:
    servers = group(False, False, False)
    passive = PassiveHealth(3)
    passive.failure(1, 50.0, servers[1])
    weights = [1, 1, 1]
    assert usable_servers(servers, weights, passive, None, 55.0, for_new_sessions=True) == [0, 2]
    assert usable_servers(servers, weights, passive, None, 60.0, for_new_sessions=True) == [
        0,
        1,
        2,
    ]


def test_usable_excludes_actively_down() -> None:
    servers = group(False, False)
    passive = PassiveHealth(2)
    active = ActiveHealth(2, HealthCheck(fails=1, passes=1))
    active.result(0, False)
    assert usable_servers(servers, [1, 1], passive, active, 0.0, for_new_sessions=False) == [1]


def test_backups_only_when_no_primary_is_usable() -> None:
    servers = group(False, True, False, True)
    passive = PassiveHealth(4)
    weights = [1, 1, 1, 1]
    assert usable_servers(servers, weights, passive, None, 0.0, for_new_sessions=True) == [0, 2]
    passive.failure(0, 0.0, servers[0])
    assert usable_servers(servers, weights, passive, None, 1.0, for_new_sessions=True) == [2]
    passive.failure(2, 1.0, servers[2])
    assert usable_servers(servers, weights, passive, None, 2.0, for_new_sessions=True) == [1, 3]
    passive.failure(3, 2.0, servers[3])
    assert usable_servers(servers, weights, passive, None, 3.0, for_new_sessions=True) == [1]
    passive.failure(1, 3.0, servers[1])
    assert usable_servers(servers, weights, passive, None, 4.0, for_new_sessions=True) == []
    # Primaries back: backups are left again (server 0 back at 10, server 2 at 11).
    assert usable_servers(servers, weights, passive, None, 10.0, for_new_sessions=True) == [0]
    assert usable_servers(servers, weights, passive, None, 11.0, for_new_sessions=True) == [0, 2]


def test_draining_servers_only_for_existing_sessions() -> None:
    servers = group(False, False, True)
    passive = PassiveHealth(3)
    weights = [0, 1, 1]
    assert usable_servers(servers, weights, passive, None, 0.0, for_new_sessions=True) == [1]
    assert usable_servers(servers, weights, passive, None, 0.0, for_new_sessions=False) == [0, 1]
    # Every primary draining: new sessions go to the backups, existing ones stay.
    weights = [0, 0, 1]
    assert usable_servers(servers, weights, passive, None, 0.0, for_new_sessions=True) == [2]
    assert usable_servers(servers, weights, passive, None, 0.0, for_new_sessions=False) == [0, 1]
    # A drained backup takes no new sessions either.
    assert usable_servers(servers, [0, 0, 0], passive, None, 0.0, for_new_sessions=True) == []
