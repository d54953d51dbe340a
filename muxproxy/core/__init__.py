"""The sans-IO proxy core: events in, commands out. No sockets, no clock, no event loop."""
