"""The fake LLM backend's LoRA adapters: the ones it holds, reported as vLLM reports them.

vLLM serves LoRA adapters by name: a request's ``model`` names the base model or an adapter,
a batch holds at most ``--max-loras`` adapters, and an adapter can be loaded at runtime;
its ``/metrics`` page says which adapters its running and waiting requests use
(``vllm:lora_requests_info``, see ``muxproxy/routing/lora.py``). The fake keeps a simpler
model, enough for a router to be tested against:

- it holds at most ``max_lora`` adapters (``--max-lora``), first those given at start
  (``--lora-adapters a,b``);
- a request whose ``model`` is not the base model's name names an adapter: it is loaded if
  not held, the least recently used one evicted when every slot is taken, and it becomes
  the most recently used; the request is answered as any other;
- ``/metrics`` reports the adapters held as ``running_lora_adapters`` (vLLM names those of
  its running requests; an idle fake still reports what it holds, so a router can be tested
  at rest), ``waiting_lora_adapters`` empty, and ``max_lora``.

Not modelled: adapter paths, load times, the engine's own limits per adapter.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import attrs

__all__ = ["LoraSlots", "requested_model"]


@attrs.define
class LoraSlots:
    """The adapters one fake engine holds, least recently used first."""

    max_lora: int = attrs.field(validator=attrs.validators.ge(1))
    held: OrderedDict[str, None] = attrs.field(factory=OrderedDict)
    loads: int = attrs.field(default=0, init=False)
    """Adapters loaded by requests (not those held from the start)."""

    @classmethod
    def of(cls, adapters: Sequence[str], max_lora: int | None) -> LoraSlots | None:
        """The slots the command line asks for; None when it asks for no LoRA. Without
        ``max_lora``, as many slots as ``adapters`` (at least 1). Raises ValueError when
        ``adapters`` are more than ``max_lora``."""
        if not adapters and max_lora is None:
            return None
        slots = max(len(adapters), 1) if max_lora is None else max_lora
        if len(adapters) > slots:
            raise ValueError(f"{len(adapters)} LoRA adapters given, more than --max-lora {slots}")
        return cls(max_lora=slots, held=OrderedDict.fromkeys(adapters))

    def use(self, name: str) -> None:
        """A request names the adapter ``name``: hold it, evicting the least recently used
        one if every slot is taken."""
        if name in self.held:
            self.held.move_to_end(name)
            return
        if len(self.held) >= self.max_lora:
            self.held.popitem(last=False)
        self.held[name] = None
        self.loads += 1

    def labels(self) -> tuple[str, str, str]:
        """vLLM's labels of ``lora_requests_info``: max_lora, waiting, running adapters."""
        return str(self.max_lora), "", ",".join(self.held)


def requested_model(request: Mapping[str, object], base: str, lora: LoraSlots | None) -> str:
    """The model a request names (``base`` when it names none); with LoRA, an adapter it
    names is used (``LoraSlots.use``)."""
    model = request.get("model")
    if not isinstance(model, str) or not model:
        return base
    if lora is not None and model != base:
        lora.use(model)
    return model
