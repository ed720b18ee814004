"""The request shapes (design: request shape, battery, comparison level): each puts a
serving engine through one history before a prefix-cache hit of a prompt, and serves
the same prompt as a reference miss (a reset cache, one prefill). A defect of the cache's
code paths shows as a hit that continues otherwise than its miss, or reads other cached
tokens than its history wrote.

Each shape is a function of a :class:`Lab` (the served model, the item's prompt P and the
row's seeded randomness) that returns a :class:`ShapeRun`. The shapes are the ones the
engines' own bugs needed (vLLM's cold/hot test, SGLang's cache-consistency test, the
fault suite's measurements in ``bench/phase2_probes.py``):

- ``warm``: P's blocks written by a one-token prefill of P;
- ``aligned``: P cut to whole blocks, warm, then the pool's other blocks (and the cut P's
  last) taken by unrelated prompts: the engine recomputes the last block into a block
  that held another prompt's K/V;
- ``one-block``: a hit whose cached prefix is exactly P's first block;
- ``second``: the second hit on the same blocks;
- ``interloper``: a warm P, then an unrelated request that takes a freed block;
- ``companion``: a prompt that agrees with P to half a block past a block boundary,
  then differs, cached first (what a block hash must tell apart);
- ``salted``: P cached under one cache salt, served under another (it must share none);
- ``twin``: P twice in one batch: the second hits what the first writes in the same step;
- ``concurrent``: the hit batched with an unrelated prompt;
- ``sampled``: hit and miss sampled at T = 0.7 with one seed;
- ``cut``: a greedy continuation of P (blocks written by decoding), then P and a seeded
  random cut of it re-submitted (SGLang's shape); the hit is also held against the live
  continuation, the paper's question inside the engine (reported, not judged);
- ``evicted``: a warm P, then unrelated prompts that take every block of the pool;
- ``preempted``: P served behind prompts that fill the pool, so that the scheduler
  preempts P and recomputes it from its tokens (vLLM's recompute path).

The batched shapes (``twin``, ``concurrent``) are compared at tokens only: a batch of two
moves a clean engine's numerics.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvreplay.core.sampler import Sampler
from kvreplay.core.stages import Stage
from kvreplay.experiments.battery.outcome import Level

if TYPE_CHECKING:
    from kvreplay.backends.served import Reply, ServedModel

NEW_TOKENS = 8
"""Tokens each continuation decodes: enough for a defect of P's K/V to reach the tokens."""
CUT_TOKENS = 32
"""Tokens the ``cut`` shape's continuation decodes before it is cut (at least one block)."""
SAMPLED_TEMPERATURE = 0.7
INTERLOPER_TOKENS = 40
CONCURRENT_TOKENS = 200
MAX_FILL_REQUESTS = 8
"""Prompts a shape sends at once to fill a pool at most (vLLM batches 8 by default); a
larger pool is not filled (the row says the shape was not exercised)."""


@dataclass(frozen=True)
class ShapeRun:
    """One shape on one item as it ran: the reference miss, the hit after the shape's
    history, the cached tokens the hit must read (None: the history leaves that open),
    whether the history happened (``exercised``; None: the engine cannot say), what it
    did (``note``), the level it is compared at, and, for ``cut``, the live
    continuation at the cut. A shape that could not run on this engine or prompt has
    neither continuation."""

    shape: str
    level: Level
    exercised: bool | None
    reference: Reply | None = None
    probe: Reply | None = None
    expected_cached_tokens: int | None = None
    note: str | None = None
    live: Reply | None = None
    prompt_tokens: int = 0  # the length of the prompt hit and miss were served


def skipped(shape: str, why: str) -> ShapeRun:
    return ShapeRun(shape, "bits", False, note=why)


@dataclass
class Lab:
    """What a shape works with: the served model, the item's prompt ``p``, the run's
    seed for the item (every random prompt and cut is drawn from it, so a
    re-execution draws the same), the hit the engine's cache granularity expects, and
    P's calibrated miss."""

    served: ServedModel
    p: list[int]
    seed: str
    expected_hit: Callable[[int], int]
    reference: Reply | None = None  # P's greedy miss, once calibrated: every shape's reference

    @property
    def block(self) -> int:
        return self.served.block_size

    def serve(self, *prompts: list[int], sampler: Sampler | None = None, salt: str | None = None,
              at: int = 0) -> Reply:  # fmt: skip
        """The continuation of prompt ``at``, served together with the others."""
        return self.together(*prompts, sampler=sampler, salt=salt)[at]

    def together(self, *prompts: list[int], sampler: Sampler | None = None,
                 salt: str | None = None) -> list[Reply]:  # fmt: skip
        """Every prompt's continuation, served together."""
        from kvreplay.backends.served import Request

        stage = Stage("battery", NEW_TOKENS)
        chosen = sampler or Sampler()
        requests = [Request(list(p), stage, chosen, salt=salt) for p in prompts]
        return self.served.serve(requests)

    def miss(self, prompt: list[int], sampler: Sampler | None = None) -> Reply:
        """``prompt`` from a reset cache: one prefill. P's greedy miss is served once and
        reused (the calibration shows a second one agrees bit for bit)."""
        if prompt == self.p and sampler is None and self.reference is not None:
            return self.reference
        self.served.reset_cache()
        return self.serve(prompt, sampler=sampler)

    def warm(self, prompt: list[int]) -> None:
        """A reset cache, then a one-token prefill of ``prompt``: its blocks cached."""
        self.served.reset_cache()
        self.prefill(prompt)

    def prefill(self, *prompts: list[int], salt: str | None = None) -> None:
        """A one-token request for each prompt, served together: their blocks written by
        a prefill and held at once."""
        from kvreplay.backends.served import Request

        stage, sampler = Stage("prefill", 1), Sampler()
        self.served.serve([Request(list(p), stage, sampler, salt=salt) for p in prompts])

    def unrelated(self, length: int, salt: str) -> list[int]:
        """Seeded random token ids (the ids the engine serves, never P's)."""
        rng = random.Random(f"{self.seed}:{salt}")
        return [rng.randrange(self.served.vocabulary) for _ in range(length)]

    def hit(self, computed: int) -> int:
        """The cached tokens a hit reads over ``computed`` tokens its history wrote."""
        return self.expected_hit(computed)

    def pool_blocks(self) -> int | None:
        """The blocks of the engine's K/V pool requests share (None: it does not say)."""
        pool = self.served.pool_tokens()
        return None if pool is None else pool // self.block

    def fillers(self, blocks: int, salt: str) -> list[list[int]] | None:
        """Unrelated prompts, each a whole number of blocks and at most a request long,
        that take ``blocks`` blocks when served together (None: none, or more prompts
        than :data:`MAX_FILL_REQUESTS`)."""
        longest = (self.served.context_length - NEW_TOKENS - 1) // self.block
        if blocks <= 0 or longest <= 0:
            return None
        lengths = [longest] * (blocks // longest) + ([blocks % longest] if blocks % longest else [])
        if len(lengths) > MAX_FILL_REQUESTS:
            return None
        return [self.unrelated(n * self.block, f"{salt}{i}") for i, n in enumerate(lengths)]


def _after(lab: Lab, shape: str, history: Callable[[], None], prompt: list[int] | None = None,
           level: Level = "bits", sampler: Sampler | None = None) -> ShapeRun:  # fmt: skip
    """The miss of ``prompt`` (P by default), then its hit after a warm prefill and
    ``history``."""
    prompt = lab.p if prompt is None else prompt
    reference = lab.miss(prompt, sampler)
    lab.warm(prompt)
    history()
    probe = lab.serve(prompt, sampler=sampler)
    expected = lab.hit(len(prompt) - 1)
    return ShapeRun(shape, level, True, reference, probe, expected, prompt_tokens=len(prompt))


def warm(lab: Lab) -> ShapeRun:
    return _after(lab, "warm", lambda: None)


def aligned(lab: Lab) -> ShapeRun:
    """P cut to whole blocks, warm, then the pool's other blocks and the last of the cut
    P's taken by unrelated prompts: the block the hit recomputes into last held another
    prompt's K/V (a recompute that writes nothing shows)."""
    blocks = len(lab.p) // lab.block
    if lab.block == 1 or blocks == 0:
        why = "the engine caches token by token" if lab.block == 1 else "P is under one block"
        return skipped("aligned", why)
    pool = lab.pool_blocks()
    if pool is None:
        return skipped("aligned", "the engine does not report its K/V pool")
    churn = lab.fillers(pool - blocks + 1, "aligned")
    if churn is None:
        return skipped("aligned", f"its pool of {pool} blocks takes too many prompts to churn")
    run = _after(lab, "aligned", lambda: lab.prefill(*churn), lab.p[: blocks * lab.block])
    return replace(run, note=f"{pool - blocks + 1} blocks churned")


def second(lab: Lab) -> ShapeRun:
    return _after(lab, "second", lambda: lab.prefill(lab.p))


SLOTS = "the engine keeps each request's K/V in a slot of its own"
"""Why a shape that needs requests to share one pool does not run on llama-server."""


def interloper(lab: Lab) -> ShapeRun:
    if lab.pool_blocks() is None:
        return skipped("interloper", SLOTS)
    other = lab.unrelated(INTERLOPER_TOKENS, "interloper")
    return _after(lab, "interloper", lambda: lab.prefill(other))


def companion(lab: Lab) -> ShapeRun:
    blocks = len(lab.p) // lab.block
    if lab.block == 1 or blocks == 0:
        why = "the engine caches token by token" if lab.block == 1 else "P is under one block"
        return skipped("companion", why)
    cut = (blocks - 1) * lab.block + lab.block // 2
    other = lab.p[:cut] + lab.unrelated(len(lab.p) - cut, "companion")
    reference = lab.miss(lab.p)
    lab.warm(other)
    probe = lab.serve(lab.p)
    return ShapeRun("companion", "bits", True, reference, probe, lab.hit(cut),
                    prompt_tokens=len(lab.p))  # fmt: skip


def one_block(lab: Lab) -> ShapeRun:
    """P's first block alone cached (a one-token prefill of one block and a token), then
    P: a hit whose cached prefix is exactly one block."""
    if lab.block == 1 or len(lab.p) <= lab.block:
        why = "the engine caches token by token" if lab.block == 1 else "P is one block or less"
        return skipped("one-block", why)
    reference = lab.miss(lab.p)
    lab.warm(lab.p[: lab.block + 1])
    probe = lab.serve(lab.p)
    return ShapeRun("one-block", "bits", True, reference, probe, lab.hit(lab.block),
                    prompt_tokens=len(lab.p))  # fmt: skip


def twin(lab: Lab) -> ShapeRun:
    """P twice in one batch from a reset cache whose blocks last held unrelated prompts:
    the second hits the blocks the first writes in the same step (tokens only: a batch
    of two)."""
    pool = lab.pool_blocks()
    churn = lab.fillers(pool, "twin") if pool is not None else None
    if churn is None:
        return skipped("twin", SLOTS if pool is None else "its pool takes too many prompts")
    reference = lab.miss(lab.p)
    lab.prefill(*churn)
    lab.served.reset_cache()
    # Sent together, the two reach the scheduler in an order the engine decides (over
    # HTTP, the network too): the hit is the one that read the other's blocks.
    probe = max(lab.together(lab.p, lab.p), key=lambda reply: reply.cached_tokens)
    expected = lab.hit(len(lab.p) - 1)
    return ShapeRun("twin", "tokens", True, reference, probe, expected, prompt_tokens=len(lab.p))


def salted(lab: Lab) -> ShapeRun:
    """P cached under one cache salt, then served under another: it must share nothing."""
    if not lab.served.salts:
        return skipped("salted", "the engine takes no cache salt")
    reference = lab.miss(lab.p)
    lab.served.reset_cache()
    lab.prefill(lab.p, salt=f"{lab.seed}:a")
    probe = lab.serve(lab.p, salt=f"{lab.seed}:b")
    return ShapeRun("salted", "bits", True, reference, probe, 0, prompt_tokens=len(lab.p))


def concurrent(lab: Lab) -> ShapeRun:
    other = lab.unrelated(CONCURRENT_TOKENS, "concurrent")
    reference = lab.miss(lab.p)
    lab.warm(lab.p)
    probe = lab.serve(lab.p, other)
    expected = lab.hit(len(lab.p) - 1)
    return ShapeRun("concurrent", "tokens", True, reference, probe, expected,
                    prompt_tokens=len(lab.p))  # fmt: skip


def sampled(lab: Lab) -> ShapeRun:
    seed = random.Random(f"{lab.seed}:sampled").randrange(2**31)
    sampler = Sampler(temperature=SAMPLED_TEMPERATURE, seed=seed)
    return _after(lab, "sampled", lambda: None, sampler=sampler)


def cut(lab: Lab) -> ShapeRun:
    from kvreplay.backends.served import Request

    lab.served.reset_cache()
    tokens = max(CUT_TOKENS, lab.block)
    stage = Stage("battery", tokens)
    live = lab.served.serve([Request(list(lab.p), stage, Sampler())])[0]
    cont = list(live.segment.token_ids)
    if len(cont) < 2:
        return skipped("cut", "P's continuation ended at once")
    at = random.Random(f"{lab.seed}:cut").randrange(1, len(cont))
    prompt = lab.p + cont[:at]
    probe = lab.serve(prompt)
    reference = lab.miss(prompt)
    after = at_cut(live, at)
    computed = len(lab.p) + len(cont) - 1  # the last token was sampled, never fed
    expected = lab.hit(min(len(prompt) - 1, computed))
    return ShapeRun("cut", "bits", True, reference, probe, expected, f"cut at {at}", after,
                    len(prompt))  # fmt: skip


def evicted(lab: Lab) -> ShapeRun:
    """A warm P, then unrelated prompts that take every block of the pool at once (where
    the engine reports its pool; else the server's own eviction of P's slot)."""
    pool = lab.pool_blocks()
    churn = lab.fillers(pool, "evicted") if pool is not None else None
    reference = lab.miss(lab.p)
    lab.warm(lab.p)
    if churn is not None:
        lab.prefill(*churn)
        sent = sum(map(len, churn))
    else:
        sent = lab.served.evict(len(lab.p), f"{lab.seed}:evicted")
    probe = lab.serve(lab.p)
    note = f"{sent} tokens of unrelated prompts sent"
    return ShapeRun("evicted", "bits", sent > 0, reference, probe, None, note,
                    prompt_tokens=len(lab.p))  # fmt: skip


PREEMPT_TRIES = 3
"""Times the preempted shape sends its requests before it says the engine did not
preempt: over HTTP they reach the scheduler at times the network and the server's
threads decide, and a P that arrives once the fillers are done is never preempted."""


def preempted(lab: Lab) -> ShapeRun:
    """P behind unrelated prompts that, with it, take every block of the pool when
    prefilled, each a whole number of blocks long: the first block any of them decodes
    into makes the scheduler preempt the request that came last, P, and recompute it
    from its tokens once blocks are free."""
    pool = lab.pool_blocks()
    if pool is None or lab.served.preemptions() is None:
        why = "the engine reports no shared K/V pool or no preemption count"
        return skipped("preempted", why)
    fillers = lab.fillers(pool - -(-len(lab.p) // lab.block), "preempted")
    if fillers is None:
        return skipped("preempted", f"its pool of {pool} blocks takes too many prompts to fill")
    from kvreplay.backends.served import Request

    reference = lab.miss(lab.p)
    stage = Stage("battery", NEW_TOKENS)
    requests = [Request(f, stage, Sampler()) for f in fillers] + [Request(lab.p, stage, Sampler())]
    tries = count = 0
    while count == 0 and tries < PREEMPT_TRIES:
        tries += 1
        lab.served.reset_cache()
        before = lab.served.preemptions() or 0.0
        probe = lab.served.serve(requests)[-1]
        count = (lab.served.preemptions() or 0.0) - before
    filled = sum(map(len, fillers))
    note = f"{count:g} preemption(s) behind {len(fillers)} prompt(s) of {filled} tokens" + (
        f" (sent {tries} times)" if tries > 1 else ""
    )
    return ShapeRun("preempted", "bits", count > 0, reference, probe, None, note,
                    prompt_tokens=len(lab.p))  # fmt: skip


def at_cut(live: Reply, at: int) -> Reply:
    """The live continuation from the cut on, as long as a battery's continuation: what
    a hit at the cut continues as if it equals the live decode."""
    from kvreplay.backends.served import Reply
    from kvreplay.core.trajectory import Segment

    segment, end = live.segment, at + NEW_TOKENS
    tail = Segment(segment.stage, [], segment.token_ids[at:end], "cap",
                   segment.margins[at:end], segment.digests[at:end])  # fmt: skip
    return Reply(tail, 0, live.steps[at:end])


SHAPES: dict[str, Callable[[Lab], ShapeRun]] = {
    "warm": warm,
    "aligned": aligned,
    "one-block": one_block,
    "second": second,
    "interloper": interloper,
    "companion": companion,
    "salted": salted,
    "twin": twin,
    "concurrent": concurrent,
    "sampled": sampled,
    "cut": cut,
    "evicted": evicted,
    "preempted": preempted,
}
"""Every shape, in the order a battery runs them: the cheap and broad first, the ones
that fill the pool last, so that a failing check stops early."""
