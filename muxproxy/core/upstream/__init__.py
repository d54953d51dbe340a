"""Backend connections: the HTTP/1.1 keep-alive pool, the multiplexed HTTP/2 pool and its
connection's life, active health checks and load reports."""
