"""SSE streams that outlive a client or a backend: event boundaries and ids, the commit point
of a held stream, resume from ``Last-Event-ID``, replay, and continuation on another backend."""
