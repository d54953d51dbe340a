"""The fake LLM backend's step planner: what one step of continuous batching does.

Pure: no trio, no I/O, no clock, no randomness. The loop that runs the steps is ``batch.py``.

What it obeys, loosely, is vLLM V1's scheduler (``vllm/v1/core/sched/scheduler.py``,
``Scheduler.schedule``: "there's no decoding phase nor prefill phase ... at each step, the
scheduler tries to assign tokens to the requests so that each request's num_computed_tokens
can catch up"), with chunked prefill:

* **One step, every running generation.** A generation whose prompt is all computed decodes:
  it has one token out at the end of the step. A generation still prefilling gets prompt
  tokens from the step's budget of ``chunk`` prefill tokens, the running generations taken
  in order, first come first served: each gets ``min(its tokens left, the budget left)``,
  so once the budget is spent the ones after it get none this step (vLLM walks its running
  list in the same way, each taking ``min(num_new_tokens, token_budget)``).
* **The first token.** A generation has its first token out at the end of the step in which
  its prefill is completed (vLLM samples from the last prompt position in that step, and
  discards what it samples in the steps of a partial prefill); with nothing to prefill, at
  the end of its first step.
* **Cost.** A step lasts ``decode`` seconds (the forward pass every running generation
  shares) plus ``per_token`` seconds for each prefill token in it (:func:`step_seconds`), so
  a long cold prompt slows every stream in the batch, not just its own first token.

Not modelled: vLLM also charges each decode one token of ``max_num_batched_tokens``; here
the budget is prefill tokens alone (with a chunk of hundreds and a few dozen streams
running, a small difference). Cached prompt tokens are never planned: the caller hands in
only the uncached ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen(kw_only=True)
class StepPlan:
    """What one step does for each running generation, in the order they were given."""

    prefill: tuple[int, ...]
    """Prompt tokens each generation prefills in this step."""
    emits: tuple[bool, ...]
    """Whether each generation has a token out at the end of this step: those that decode,
    and those whose prefill is completed in it."""

    @property
    def prefill_tokens(self) -> int:
        """Prefill tokens in this step, all generations together (at most the chunk)."""
        return sum(self.prefill)


def plan_step(prefill_left: Sequence[int], chunk: int) -> StepPlan:
    """The step for generations with ``prefill_left`` prompt tokens still to compute each
    (in arrival order; 0: decoding) and a budget of ``chunk`` prefill tokens (see the
    header). A negative count is taken as 0, a chunk below 0 as 0 (nothing prefills)."""
    budget = max(chunk, 0)
    prefill: list[int] = []
    emits: list[bool] = []
    for left in prefill_left:
        left = max(left, 0)
        taken = min(left, budget)
        budget -= taken
        prefill.append(taken)
        emits.append(taken == left)
    return StepPlan(prefill=tuple(prefill), emits=tuple(emits))


def step_seconds(prefill_tokens: int, *, decode: float, per_token: float) -> float:
    """How long a step with ``prefill_tokens`` of prefill lasts: ``decode + per_token *
    prefill_tokens``."""
    return decode + per_token * prefill_tokens
