"""One request's life from the client's head to the end of the response: its phases, deadlines,
heads and upload, and where it goes (placement: route, admission, budgets, failover, the
shared session memory) as calls out of the exchange into ``muxproxy.routing``."""
