"""The Trio driver: runs the sans-IO core on real sockets."""
