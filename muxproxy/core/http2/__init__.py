"""HTTP/2 (RFC 9113) through h2: the client-facing and backend-facing adapters, their send
queues, settings, HPACK decoding limits, the preface, GOAWAY, abuse accounting and the
streams that wait for a client's window."""
