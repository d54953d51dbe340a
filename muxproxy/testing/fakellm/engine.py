"""The fake LLM backend's model of an inference engine: its prompt tokens, its prefix KV cache.

Pure: no trio, no I/O, no clock (nothing here depends on time; the scheduler in
``scheduler.py`` does the waiting), no randomness. Opt-in: :class:`EngineConfig` says whether
the model is on at all; off, the fake backend behaves as it always has. Its prefill is
``prefill_seconds`` of a generation's own, or, with ``prefill_chunk`` (the step model), shared
out step by step among the running generations (``steps.py``, run by ``batch.py``).

What it obeys, loosely, is vLLM's automatic prefix caching (vLLM v1, ``vllm/v1/core/
kv_cache_manager.py``, ``block_pool.py``, ``kv_cache_utils.py``; "Automatic Prefix Caching" in
vLLM's design docs):

* **Tokens.** A prompt's text (:func:`prompt_text`) is encoded as UTF-8 and cut into 4-byte
  chunks; each chunk is one token (:data:`TOKEN_BYTES`). Real tokenisers give roughly four
  bytes of English a token, so sizes come out about right, and the cut is cheap and
  deterministic: the same text always gives the same tokens, in any process.
* **Blocks.** Tokens are grouped into blocks of ``block_tokens`` (vLLM's ``block_size``, 16 by
  default). Only full blocks are cached. A block is named by a hash over its parent's hash
  and its own bytes (:func:`block_hashes`), so a block's name stands for the whole prefix up
  to and including it: two prompts share a cached block only if everything before it is the
  same too, and the same text after a different prefix is a different block.
* **Lookup.** At admission the leading blocks already cached are hits; the first miss ends
  the hit run. The last prompt token is always computed (vLLM caps a hit at ``num_tokens -
  1`` so the engine has logits to sample from), so a block reaching the prompt's last token
  is never a hit.
* **Generated tokens.** When a request ends, the full blocks of what it generated are
  cached too (vLLM caches a request's blocks as they fill, output as well as prompt), so
  the next turn of a conversation, which sends the history with this reply in it, hits
  them. The generated tokens follow the prompt's text and the reply's lead
  (:class:`EnginePrompt`: ``"assistant: "`` for a chat, how :func:`prompt_text` renders
  the assistant message the reply becomes; nothing for a completion's ``prompt``), and
  their text is the fake's answer (``answer.py``, tokens ``0 .. n - 1`` for ``n``
  generated). A continuation's output is cached as such an answer too (vLLM's would follow
  the continued message directly: not modelled). They are cached at the end, not pinned
  while the request runs, so :attr:`PrefixCache.usage` leaves them out.
* **Pinning and eviction.** A running request holds (pins) all its full blocks; a pinned
  block is never evicted. When the request ends its blocks are unpinned in reverse order,
  becoming the most recently used (vLLM frees a request's blocks tail first, "so that the
  tail blocks are evicted first"). A new block takes a free slot, else evicts the least
  recently unpinned block; with every block pinned it is computed and not kept (vLLM would
  make the request wait for KV space or preempt another; that is not modelled).
* **Usage.** :attr:`PrefixCache.usage` is the fraction of the ``capacity`` blocks pinned by
  running requests. That is what vLLM reports as ``vllm:kv_cache_usage_perc``: its free
  block queue holds the cached blocks no request uses, so they count as free. A request's
  partial last block and, while it runs, the blocks of its generated tokens are not
  modelled.
* **Counts.** :attr:`PrefixCache.queried_tokens` and :attr:`PrefixCache.hit_tokens` are
  vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``: prompt tokens looked up, and those
  found cached.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

TOKEN_BYTES = 4
"""Bytes of UTF-8 prompt text per token (about what real tokenisers give for English)."""

DEFAULT_BLOCK_TOKENS = 16
"""Tokens per KV block: vLLM's default ``block_size`` on GPUs."""

_ROOT_HASH = hashlib.sha256(b"muxproxy fake engine").digest()
"""The parent hash of a prompt's first block (vLLM seeds its chain with ``NONE_HASH``)."""


def prompt_text(request: Mapping[str, object]) -> str:
    """The text a request's prompt is tokenised from.

    Chat ``messages``: each message's role and content, in order, as ``"<role>: <content>\\n"``
    (a string content, or the ``text`` of its ``{"type": "text"}`` parts). Without
    ``messages``, a string ``prompt``. Anything malformed is skipped, never raised on.
    """
    messages = request.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            role = message.get("role")
            parts.append(f"{role if isinstance(role, str) else ''}: {content_text(message)}\n")
        return "".join(parts)
    prompt = request.get("prompt")
    return prompt if isinstance(prompt, str) else ""


CHAT_REPLY_LEAD = "assistant: "
"""What a chat's reply follows in the engine's token sequence: :func:`prompt_text` renders an
assistant message as ``"assistant: <content>\\n"``, so the reply's blocks are those the next
turn's prompt holds (the chat template's generation prompt, in vLLM)."""


@attrs.frozen(kw_only=True)
class EnginePrompt:
    """A request's prompt text and what its generated tokens follow."""

    text: str
    """:func:`prompt_text` of the request."""
    reply_lead: str | None
    """Text between the prompt and the generated tokens (:data:`CHAT_REPLY_LEAD` for chat
    ``messages``, ``""`` for a ``prompt``); None: the generated tokens are not cached."""

    @classmethod
    def of(cls, request: Mapping[str, object]) -> EnginePrompt:
        """The engine's view of ``request``: its text, and the lead of a chat's reply."""
        chat = isinstance(request.get("messages"), list)
        return cls(text=prompt_text(request), reply_lead=CHAT_REPLY_LEAD if chat else "")

    @classmethod
    def uncached_output(cls, text: str) -> EnginePrompt:
        """A prompt ``text`` whose generated tokens are not cached."""
        return cls(text=text, reply_lead=None)


def content_text(message: Mapping[str, object]) -> str:
    """A message's text: a string content, or the ``text`` of its ``{"type": "text"}`` parts
    joined (anything else: ``""``)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(
        part["text"]
        for part in content
        if isinstance(part, dict)
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
    )


def token_count(text: str) -> int:
    """How many tokens ``text`` is: its UTF-8 length over :data:`TOKEN_BYTES`, rounded up."""
    return -(-len(text.encode()) // TOKEN_BYTES)


def block_hashes(text: str, block_tokens: int) -> list[bytes]:
    """The chained hashes of the full blocks of ``text`` (a partial last block has none).

    ``hash[i] = sha256(hash[i - 1] + bytes of block i)``, as vLLM's ``hash_block_tokens``
    chains a block to its parent.
    """
    data = text.encode()
    size = block_tokens * TOKEN_BYTES
    hashes: list[bytes] = []
    parent = _ROOT_HASH
    for start in range(0, len(data) - size + 1, size):
        parent = hashlib.sha256(parent + data[start : start + size]).digest()
        hashes.append(parent)
    return hashes


def output_blocks(prompt: EnginePrompt, reply: str, block_tokens: int) -> list[bytes]:
    """The chained hashes of the full blocks that ``reply``, generated after ``prompt``,
    completes: those of the whole sequence (prompt, lead, reply) past the prompt's own
    (none when the prompt's ``reply_lead`` is None or nothing was generated)."""
    if prompt.reply_lead is None or not reply:
        return []
    sequence = block_hashes(prompt.text + prompt.reply_lead + reply, block_tokens)
    return sequence[len(prompt.text.encode()) // (block_tokens * TOKEN_BYTES) :]


@attrs.frozen(kw_only=True)
class Prompt:
    """One request's prompt as the engine sees it."""

    tokens: int
    """Prompt tokens (:func:`token_count`)."""
    blocks: tuple[bytes, ...]
    """The chained hashes of its full blocks (:func:`block_hashes`)."""

    @classmethod
    def from_text(cls, text: str, block_tokens: int) -> Prompt:
        """The prompt of ``text``, cut into blocks of ``block_tokens`` tokens."""
        return cls(tokens=token_count(text), blocks=tuple(block_hashes(text, block_tokens)))


@attrs.frozen(kw_only=True)
class Admission:
    """What admitting one prompt found; hand it back to :meth:`PrefixCache.release`."""

    prompt_tokens: int
    hit_tokens: int
    """Leading prompt tokens found cached (whole blocks)."""
    pinned: tuple[bytes, ...]
    """The blocks this request holds until it is released (those that found room)."""

    @property
    def uncached_tokens(self) -> int:
        """Prompt tokens to prefill."""
        return self.prompt_tokens - self.hit_tokens


@attrs.define
class PrefixCache:
    """A prefix KV cache of ``capacity`` blocks of ``block_tokens`` tokens each (see the header)."""

    capacity: int = attrs.field(validator=attrs.validators.ge(0))
    block_tokens: int = attrs.field(default=DEFAULT_BLOCK_TOKENS, validator=attrs.validators.ge(1))

    queried_tokens: int = attrs.field(default=0, init=False)
    """Prompt tokens looked up, all admissions together (vLLM's ``prefix_cache_queries``)."""
    hit_tokens: int = attrs.field(default=0, init=False)
    """Prompt tokens found cached, all admissions together (vLLM's ``prefix_cache_hits``)."""

    _refs: dict[bytes, int] = attrs.field(factory=dict, init=False, repr=False)
    """Every cached block -> how many running requests pin it."""
    _unpinned: OrderedDict[bytes, None] = attrs.field(factory=OrderedDict, init=False, repr=False)
    """Cached blocks no request pins, least recently used first: the ones that may be evicted."""

    @property
    def cached_blocks(self) -> int:
        """Blocks cached, pinned or not."""
        return len(self._refs)

    @property
    def pinned_blocks(self) -> int:
        """Blocks pinned by running requests."""
        return len(self._refs) - len(self._unpinned)

    @property
    def usage(self) -> float:
        """Pinned blocks over capacity, 0..1 (vLLM's ``kv_cache_usage_perc``); 0 with no blocks."""
        return self.pinned_blocks / self.capacity if self.capacity else 0.0

    def is_cached(self, block: bytes) -> bool:
        """Whether ``block`` (a chained hash) is cached."""
        return block in self._refs

    def admit(self, prompt: Prompt) -> Admission:
        """Look ``prompt`` up, pin its cached blocks and cache (and pin) the missing ones."""
        # vLLM computes at least the last token: only blocks ending before it can hit.
        hittable = max(prompt.tokens - 1, 0) // self.block_tokens
        hits = 0
        while hits < min(hittable, len(prompt.blocks)) and prompt.blocks[hits] in self._refs:
            hits += 1
        pinned: list[bytes] = []
        for block in prompt.blocks:
            if block in self._refs:
                self._pin(block)
            elif not self._make_room():
                continue  # every block is pinned: computed, not kept
            else:
                self._refs[block] = 1
            pinned.append(block)
        hit_tokens = hits * self.block_tokens
        self.queried_tokens += prompt.tokens
        self.hit_tokens += hit_tokens
        return Admission(prompt_tokens=prompt.tokens, hit_tokens=hit_tokens, pinned=tuple(pinned))

    def release(self, admission: Admission, generated: Sequence[bytes] = ()) -> None:
        """Cache ``generated`` (the chained hashes of the full blocks after the prompt's, of
        the tokens the request generated; see the header), then unpin every block
        ``admission`` holds and those, tail first (they become the most recent)."""
        held = list(admission.pinned)
        for block in generated:
            if block in self._refs:
                self._pin(block)
            elif self._make_room():
                self._refs[block] = 1
            else:
                break  # every block is pinned: the rest of the chain could never hit
            held.append(block)
        for block in reversed(held):
            refs = self._refs[block] - 1
            self._refs[block] = refs
            if refs == 0:
                self._unpinned[block] = None

    def _pin(self, block: bytes) -> None:
        if self._refs[block] == 0:
            del self._unpinned[block]
        self._refs[block] += 1

    def _make_room(self) -> bool:
        """Free a slot for one new block (evicting the least recent unpinned); False if none."""
        if len(self._refs) < self.capacity:
            return True
        if not self._unpinned:
            return False
        evicted, _ = self._unpinned.popitem(last=False)
        del self._refs[evicted]
        return True


def _seconds_or_none(
    _instance: object, attribute: attrs.Attribute[Any], value: float | None
) -> None:
    if value is not None and not 0 <= value < float("inf"):
        raise ValueError(f"{attribute.name}: expected finite seconds >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """The engine model's options; it is on when any of them but ``block_tokens`` is given."""

    max_running: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    """At most this many generations at once; the rest wait, first come first served."""
    kv_blocks: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(0))
    )
    """Blocks of the prefix KV cache (None: no cache, every prompt token is prefilled)."""
    block_tokens: int = attrs.field(default=DEFAULT_BLOCK_TOKENS, validator=attrs.validators.ge(1))
    """Tokens per KV block."""
    ttft_base: float | None = attrs.field(default=None, validator=_seconds_or_none)
    """Seconds from admission to the first token with nothing to prefill (None: 0)."""
    prefill_per_token: float | None = attrs.field(default=None, validator=_seconds_or_none)
    """Seconds of prefill per uncached prompt token (None: 0)."""
    prefill_chunk: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    """The step model: prefill tokens per engine step, all generations together (None: each
    generation prefills on its own, see ``steps.py``)."""
    decode_seconds: float = attrs.field(default=0.0, validator=_seconds_or_none)
    """The step model: seconds of a step's decode (the fake's ``delay``); unused without it."""

    @property
    def enabled(self) -> bool:
        """Whether the model is on (any option but ``block_tokens`` and ``decode_seconds``)."""
        options: Sequence[object] = (
            self.max_running,
            self.kv_blocks,
            self.ttft_base,
            self.prefill_per_token,
            self.prefill_chunk,
        )
        return any(option is not None for option in options)

    @property
    def stepped(self) -> bool:
        """Whether generations run in steps of one batch (``prefill_chunk`` given)."""
        return self.prefill_chunk is not None

    def prefill_seconds(self, uncached_tokens: int) -> float:
        """Admission to first token: ``ttft_base + prefill_per_token * uncached_tokens``."""
        return (self.ttft_base or 0.0) + (self.prefill_per_token or 0.0) * uncached_tokens
