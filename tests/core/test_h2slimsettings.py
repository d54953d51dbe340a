"""``SlimSettings``: h2's ``Settings`` in a few hundred bytes, the same object to h2 and to us."""

from __future__ import annotations

import gc
import tracemalloc

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest
from h2.settings import SettingCodes

from muxproxy.core.http2.h2settings import server_connection
from muxproxy.core.http2.h2slimsettings import SlimSettings

INITIAL = {SettingCodes.MAX_CONCURRENT_STREAMS: 100, SettingCodes.MAX_HEADER_LIST_SIZE: 65536}


def changes(acked: dict[int, h2.settings.ChangedSetting]) -> list[tuple[object, ...]]:
    return [(int(c.setting), c.original_value, c.new_value) for c in acked.values()]


def both(client: bool, initial: dict[SettingCodes, int] | None) -> list[h2.settings.Settings]:
    return [
        h2.settings.Settings(client=client, initial_values=initial),
        SlimSettings(client=client, initial_values=initial),
    ]


@pytest.mark.parametrize("client", [True, False])
@pytest.mark.parametrize("initial", [None, INITIAL])
def test_reads_writes_and_acknowledgements_are_h2s(
    client: bool, initial: dict[SettingCodes, int] | None
) -> None:
    theirs, ours = both(client, initial)
    assert list(ours.items()) == list(theirs.items())
    for name in (
        "header_table_size",
        "enable_push",
        "initial_window_size",
        "max_frame_size",
        "max_concurrent_streams",
        "max_header_list_size",
        "enable_connect_protocol",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    # Two SETTINGS frames in flight, then a code neither knew: each ACK applies one frame.
    for settings in (theirs, ours):
        settings.update({SettingCodes.INITIAL_WINDOW_SIZE: 0, SettingCodes.MAX_FRAME_SIZE: 32768})
        settings[SettingCodes.INITIAL_WINDOW_SIZE] = 1000
        settings[0x99] = 7
    assert ours[SettingCodes.INITIAL_WINDOW_SIZE] == theirs[SettingCodes.INITIAL_WINDOW_SIZE]
    assert ours.get(0x99) is theirs.get(0x99) is None
    for _ in range(3):
        assert changes(ours.acknowledge()) == changes(theirs.acknowledge())
        assert ours.initial_window_size == theirs.initial_window_size
        assert ours.max_frame_size == theirs.max_frame_size
    assert ours[0x99] == theirs[0x99] == 7
    ours.max_concurrent_streams = theirs.max_concurrent_streams = 5
    ours.acknowledge()
    theirs.acknowledge()
    assert ours.max_concurrent_streams == theirs.max_concurrent_streams == 5
    del ours[0x99], theirs[0x99]
    assert dict(ours) == dict(theirs)
    fresh = SlimSettings(client=client, initial_values=initial)
    assert ours != fresh
    assert fresh == SlimSettings(client=client, initial_values=initial)


@pytest.mark.parametrize(
    ("code", "value", "role_matters"),
    [
        (SettingCodes.ENABLE_PUSH, 2, False),
        (SettingCodes.ENABLE_PUSH, 1, True),
        (SettingCodes.INITIAL_WINDOW_SIZE, 2**31, False),
        (SettingCodes.MAX_FRAME_SIZE, 16383, False),
        (SettingCodes.MAX_FRAME_SIZE, 2**24, False),
        (SettingCodes.MAX_HEADER_LIST_SIZE, -1, False),
        (SettingCodes.ENABLE_CONNECT_PROTOCOL, 2, False),
    ],
)
def test_invalid_values_are_refused_as_h2_refuses_them(
    code: SettingCodes, value: int, role_matters: bool
) -> None:
    for client in (True, False):
        theirs, ours = both(client, None)
        refused = not role_matters or not client
        for settings in (theirs, ours):
            if refused:
                with pytest.raises(h2.exceptions.InvalidSettingsValueError) as error:
                    settings.validate_received_setting(code, value)
            else:
                settings.validate_received_setting(code, value)
        if refused:
            with pytest.raises(h2.exceptions.InvalidSettingsValueError) as mine:
                ours.validate_received_setting(code, value)
            assert mine.value.error_code == error.value.error_code
        if not role_matters:
            for settings in (theirs, ours):
                with pytest.raises(h2.exceptions.InvalidSettingsValueError):
                    settings[code] = value
            with pytest.raises(h2.exceptions.InvalidSettingsValueError):
                SlimSettings(client=client, initial_values={code: value})


def test_a_client_sees_the_same_settings_and_windows_through_our_server() -> None:
    """The bytes our server connection sends, and what it makes of a client's SETTINGS
    (a zero window, then a larger frame size), are what h2's own Settings give."""
    conn, _ = server_connection(
        max_concurrent_streams=100,
        initial_window=256 * 1024,
        max_header_list_size=65536,
        connection_window=16 * 1024 * 1024,
        upgrade_settings=None,
    )
    assert isinstance(conn.local_settings, SlimSettings)
    assert isinstance(conn.remote_settings, SlimSettings)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 0})
    events = conn.receive_data(client.data_to_send())
    assert [type(e) for e in events][:1] == [h2.events.RemoteSettingsChanged]
    client_events = client.receive_data(conn.data_to_send())
    acked = [e for e in client_events if isinstance(e, h2.events.SettingsAcknowledged)]
    assert acked, client_events
    assert client.remote_settings.max_concurrent_streams == 100
    assert client.remote_settings.initial_window_size == 256 * 1024
    assert client.remote_settings.max_header_list_size == 65536
    assert client.remote_settings.enable_connect_protocol == 1
    assert conn.remote_settings.initial_window_size == 0
    events = conn.receive_data(client.data_to_send())  # the client's ACK of ours
    assert any(isinstance(e, h2.events.SettingsAcknowledged) for e in events)
    assert conn.local_settings.initial_window_size == 256 * 1024
    client.update_settings({SettingCodes.MAX_FRAME_SIZE: 65536})
    conn.receive_data(client.data_to_send())
    assert conn.max_outbound_frame_size == 65536


def test_an_http2_connection_holds_no_deque_per_setting() -> None:
    """h2's Settings kept each of some 13 values in a deque of 760 bytes: 16 KiB per client
    connection in all, held as long as it is open. Now under 12 KiB (7.4 measured)."""

    def build() -> object:
        return server_connection(
            max_concurrent_streams=100,
            initial_window=256 * 1024,
            max_header_list_size=65536,
            connection_window=16 * 1024 * 1024,
            upgrade_settings=None,
        )

    build()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        kept = [build() for _ in range(20)]
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    held = sum(stat.size_diff for stat in after.compare_to(before, "filename")) / len(kept)
    assert held < 12 * 1024, held
