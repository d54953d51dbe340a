"""The processes of muxproxy: the command line, the admin command line, ``muxproxy check``,
one serving process, the supervisor of ``--workers N`` and its workers' supervision, and the
signals each of them obeys."""
