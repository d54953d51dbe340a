"""One client connection: its life as a table, which protocol it speaks, its output and
backpressure, and the refusals the proxy answers itself."""
