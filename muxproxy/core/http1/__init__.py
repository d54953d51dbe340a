"""HTTP/1.1 (RFC 9112) through h11: the client-facing and backend-facing adapters, the chunked
coding of a backend's body, the h2c upgrade's HTTP/1.1 side and the status line's reason."""
