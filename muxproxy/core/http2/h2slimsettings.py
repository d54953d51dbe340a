"""HTTP/2 settings of one connection (RFC 9113 §6.5), kept in a few hundred bytes.

python-h2's ``Settings`` keeps every setting, local and remote, in a ``collections.deque`` of
its proposed values (760 bytes for one integer): some 10 KiB per connection, held for the
connection's life, which is most of what an idle or stalled HTTP/2 client costs us beyond its
streams. ``SlimSettings`` is the same object as h2 documents it, held differently: the current
values in one dict, the values sent or received and not yet acknowledged (RFC 9113 §6.5.3) in
a second one that exists only while some are in flight. It replaces ``local_settings`` and
``remote_settings`` of a new ``H2Connection`` (public attributes, as the initial values h2's
documentation shows) before any frame is sent or received.

Kept exactly as h2's ``Settings`` (h2 4.x), what h2 and its users see:

- ``settings[code]`` is the current value; a code only proposed (received, not yet
  acknowledged) is a ``KeyError``, as one never set; ``max_concurrent_streams`` and
  ``max_header_list_size`` default as h2's (unbounded, None);
- setting a value validates it (h2's own rules: ``Settings.validate_received_setting`` of a
  shared h2 ``Settings``, the public check) and queues it; ``acknowledge()`` applies the oldest
  queued value of each code and returns h2's ``ChangedSetting`` for each, as one SETTINGS ACK
  applies one SETTINGS frame;
- the codes iterate in h2's order (the defaults, then the initial values), so the SETTINGS
  frame h2 writes from them is the same bytes.

Iteration yields only codes with a current value (h2's would raise ``KeyError`` from
``items()`` for a code only proposed; h2 iterates only at the start, before any is).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import h2.settings
from h2.settings import ChangedSetting, SettingCodes

UNBOUNDED_STREAMS = 2**32 + 1
"""h2's ``max_concurrent_streams`` when the peer set none (RFC 9113 §6.5.2: no limit)."""

_CHECKS = {
    client: h2.settings.Settings(client=client, initial_values=None) for client in (True, False)
}
"""h2's validation, through its public method: ``client=True`` checks as h2's ``__setitem__``
does (no role), ``client=False`` also refuses ENABLE_PUSH 1 from a server (RFC 9113 §6.5.2)."""


class SlimSettings(h2.settings.Settings):
    """h2's ``Settings``, with its state in two small dicts instead of a deque per code.

    A subclass so that h2 and mypy take it where a ``Settings`` goes; it overrides every
    method that reaches h2's storage (the properties read through ``__getitem__``/``get``).
    """

    def __init__(
        self, client: bool = True, initial_values: Mapping[SettingCodes, int] | None = None
    ) -> None:
        # h2's __init__ is not called: it builds the deques this class exists to avoid.
        self.client = client
        self.current: dict[SettingCodes | int, int] = {
            SettingCodes.HEADER_TABLE_SIZE: 4096,
            SettingCodes.ENABLE_PUSH: int(client),
            SettingCodes.INITIAL_WINDOW_SIZE: 65535,
            SettingCodes.MAX_FRAME_SIZE: 16384,
            SettingCodes.ENABLE_CONNECT_PROTOCOL: 0,
        }
        self.proposed: dict[SettingCodes | int, list[int]] | None = None
        """Values set and not yet acknowledged, oldest first (None: none in flight)."""
        for key, value in (initial_values or {}).items():
            _CHECKS[True].validate_received_setting(key, value)
            self.current[key] = value

    def acknowledge(self) -> dict[SettingCodes | int, ChangedSetting]:
        """One SETTINGS frame acknowledged: the oldest proposed value of each code applies."""
        changed: dict[SettingCodes | int, ChangedSetting] = {}
        proposed = self.proposed
        if proposed is None:
            return changed
        for key, values in list(proposed.items()):
            new = values.pop(0)
            changed[key] = ChangedSetting(key, self.current.get(key), new)
            self.current[key] = new
            if not values:
                del proposed[key]
        if not proposed:
            self.proposed = None
        return changed

    @property
    def max_concurrent_streams(self) -> int:
        return self.current.get(SettingCodes.MAX_CONCURRENT_STREAMS, UNBOUNDED_STREAMS)

    @max_concurrent_streams.setter
    def max_concurrent_streams(self, value: int) -> None:
        self[SettingCodes.MAX_CONCURRENT_STREAMS] = value

    @property
    def max_header_list_size(self) -> int | None:
        return self.current.get(SettingCodes.MAX_HEADER_LIST_SIZE)

    @max_header_list_size.setter
    def max_header_list_size(self, value: int) -> None:
        self[SettingCodes.MAX_HEADER_LIST_SIZE] = value

    def __getitem__(self, key: SettingCodes | int) -> int:
        return self.current[key]

    def __setitem__(self, key: SettingCodes | int, value: int) -> None:
        _CHECKS[True].validate_received_setting(key, value)
        if self.proposed is None:
            self.proposed = {}
        self.proposed.setdefault(key, []).append(value)

    def validate_received_setting(self, setting: SettingCodes | int, value: int) -> None:
        _CHECKS[self.client].validate_received_setting(setting, value)

    def __delitem__(self, key: SettingCodes | int) -> None:
        del self.current[key]
        if self.proposed is not None:
            self.proposed.pop(key, None)

    def __iter__(self) -> Iterator[SettingCodes | int]:
        return iter(self.current)

    def __len__(self) -> int:
        return len(self.current)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SlimSettings):
            return self.current == other.current and self.proposed == other.proposed
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        if isinstance(other, SlimSettings):
            return not self == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, as h2's: not hashable
