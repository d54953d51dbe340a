"""A reload of ``serve --workers N`` (SIGHUP, or ``POST /reload``), as the workers take it.

The supervisor (:mod:`muxproxy.process.workers`) decides whether a reload is applied; this module
does its two steps that stand alone:

* :func:`reread`: the configuration file read again with ``load_config`` (the checker of
  ``muxproxy check``), ``--log-level`` over its ``[log] level`` as at the start; an invalid
  file gives every problem, each naming the file, so the log says which file was refused.
* :func:`reload_each`: the "reload" message to every worker at once, each with the new
  configuration and its own slot's sockets of the listeners added
  (:func:`~muxproxy.process.handover.slot_fds`, sent with the message as ``SCM_RIGHTS``). A
  worker that applied it runs the new generation from then on; one that refused it, exited
  or gave no answer within :data:`~muxproxy.process.workerproc.REPLY_TIMEOUT` is named in the
  errors returned, and keeps running the generation it had.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial

import attrs
import trio

from muxproxy.config import Config, ConfigError, load_config
from muxproxy.process.handover import SlotSockets, slot_fds
from muxproxy.process.worker import encode_config
from muxproxy.process.workerproc import REPLY_TIMEOUT, Worker, gather

__all__ = ["reload_each", "reread"]


def reread(path: str, log_level: str | None) -> Config | list[str]:
    """The configuration in the file at ``path``, with ``log_level`` (``--log-level``, when
    given) as its ``[log] level``; or, when the file is invalid, its problems, each naming
    the file."""
    try:
        config = load_config(path)
        if log_level is not None:
            config = attrs.evolve(config, log=attrs.evolve(config.log, level=log_level))
    except ConfigError as exc:
        return [p if p.startswith(path) else f"{path}: {p}" for p in exc.problems]
    return config


async def reload_each(
    workers: Sequence[Worker],
    config: Config,
    added: dict[str, SlotSockets],
    generation: int,
    ids: Iterator[int],
) -> list[str]:
    """Send ``config`` as "reload" to each of ``workers`` at once, with its slot's sockets of
    the ``added`` listeners; a worker that applied it gets ``generation``. What went wrong,
    one message per worker (empty: every worker applied it)."""
    encoded = encode_config(config)
    errors: list[str] = []

    async def reload_one(worker: Worker) -> None:
        fds = slot_fds(added, worker.slot)
        message = {
            "type": "reload",
            "config": encoded,
            "listeners": {address: len(f) for address, f in fds.items()},
        }
        flat = [fd for f in fds.values() for fd in f]
        try:
            reply = await worker.request(message, next(ids), flat)
        except trio.BrokenResourceError:
            errors.append(f"worker {worker.pid} exited during the reload")
        except trio.TooSlowError:
            errors.append(f"worker {worker.pid} did not answer within {REPLY_TIMEOUT:g}s")
        else:
            if reply["ok"]:
                worker.generation = generation
            else:
                errors.append(f"worker {worker.pid}: {reply['error']}")

    await gather(*(partial(reload_one, worker) for worker in workers))
    return errors
