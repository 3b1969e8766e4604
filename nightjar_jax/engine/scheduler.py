"""Continuous batching (host side, no JAX): admission, chunked prefill, decode, preemption, abort.

Each step is either a prefill step or a decode step (prefill first, as in vLLM v0 and nano-vllm: new requests
start as soon as they can, and a per-step token budget chunks long prompts so decodes are not starved for long).

- Admission: waiting requests are admitted first-come-first-served while a sequence slot is free and the pool
  holds pages for the whole remaining prompt plus one token. Admitting for the whole prompt means an admitted
  prefill never has to wait for pages halfway.
- Prefill: requests with more than one unprocessed token get a chunk of at most ``max_num_batched_tokens``
  tokens in total per step; a chunk that reaches the end of the tokens samples the next one.
- Decode: every fully prefilled running request processes its last token (plus ``lookahead`` speculative
  positions, γ). Pages for those positions are reserved first; when the pool runs dry the most recently admitted
  request is preempted (its pages freed, the request requeued at the front of the waiting queue to be recomputed).
- Prefix caching (on by default): a request admitted with nothing computed takes, shared, the cached pages of the
  longest run of its full pages that an earlier or running request computed (the same tokens from the first), up to
  but not including its last token (whose logits sample the next one), and starts its prefill after them. Pages full of
  computed tokens are registered after every step and when a request leaves or is preempted
  (``nightjar_jax/cache/allocator.py``). A request whose next page a running request is still prefilling waits
  for it (``_awaits_prefix``). Requests asking for prompt log-probabilities compute their whole prompt. With a
  draft, registered pages the draft has run over are marked as holding its K/V too, and a hit starts the draft
  after the leading run of such pages (``Request.num_draft_computed``) instead of catching it up from the first.
- Priority (``scheduling_policy="priority"``, vLLM's): the waiting queue is kept in (priority, arrival) order, lower
  first, so admission takes the most urgent request first; a preempted request goes back to its place in that order
  (fcfs: to the front), and the victim is the running request latest in that order (fcfs: the last admitted).
- Nothing is dropped: every request leaves through :meth:`finish` with a finish reason, and its pages go back.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
from dataclasses import dataclass

from nightjar_jax.cache.allocator import PageAllocator, page_hashes
from nightjar_jax.config import SchedulerConfig
from nightjar_jax.engine.request import FinishReason, Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """The work of one step, handed from the scheduler to the runner."""

    kind: str  # "prefill" or "decode"
    requests: list[Request]  # in batch order
    num_new_tokens: list[int]  # per request: tokens processed this step (decode: 1)
    lookahead: int = 0  # decode only: speculative positions reserved per request (γ)
    preempted: list[Request] | None = None  # requests preempted while scheduling this step

    @property
    def num_seqs(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, max_model_len: int,
                 prefix_caching: bool = False):
        self.config = config
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.prefix_caching = prefix_caching
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order; the last one is preempted first (fcfs)
        self.by_priority = config.scheduling_policy == "priority"
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        # prefix caching: tokens of the requests admitted with a lookup, of those the cached pages covered, and of
        # those the pages' draft K/V covered too
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.num_prefix_draft_hits = 0

    # ---- queues ---------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.arrival_order = next(self._arrivals)
        if self.by_priority:
            self._enqueue(request)
        else:
            self.waiting.append(request)

    @staticmethod
    def _rank(r: Request) -> tuple[int, int]:
        """Priority order: lower priority values first, then arrival."""
        return r.priority, r.arrival_order

    def _enqueue(self, r: Request) -> None:
        """Into the waiting queue at its place in priority order (after the equals that arrived earlier)."""
        self.waiting.insert(bisect.bisect_right([self._rank(q) for q in self.waiting], self._rank(r)), r)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_decoding(self) -> int:
        return sum(1 for r in self.running if not r.is_prefilling)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request: free its pages and take it out of whichever queue holds it."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free_pages(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    # ---- scheduling -----------------------------------------------------------------------------------------
    def schedule(self, lookahead: int = 0) -> ScheduledBatch | None:
        """Pick this step's work. ``lookahead`` is γ for a decode step (pages for γ extra positions)."""
        batch = self.schedule_prefill()
        if batch is not None:
            return batch
        return self.schedule_decode(lookahead)

    def schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        requests: list[Request] = []
        chunks: list[int] = []
        # Running requests mid-prefill (chunked, or resumed after a preemption) come first.
        for r in self.running:
            if budget <= 0:
                break
            if r.is_prefilling:
                chunk = min(r.num_tokens - r.num_computed, budget)
                requests.append(r)
                chunks.append(chunk)
                budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            r = self.waiting[0]
            if not r.is_prefilling:  # one token to process: a decode step will take it
                if not self._admit(r):
                    break
                continue
            if self._awaits_prefix(r) or not self._admit(r):
                break
            chunk = min(r.num_tokens - r.num_computed, budget)
            requests.append(r)
            chunks.append(chunk)
            budget -= chunk
        if not requests:
            return None
        return ScheduledBatch("prefill", requests, chunks)

    def pages_to_admit(self, r: Request) -> int:
        """Free pages admitting ``r`` takes: its whole remaining prompt plus one token, less the cached pages it
        would share (those nobody holds still take a free page each)."""
        hits, new = self._admission(r)
        return new + self.allocator.num_unheld(hits)

    def _admission(self, r: Request) -> tuple[list[int], int]:
        """What admitting ``r`` takes: the cached pages it would share, and the new pages for the rest of its
        tokens plus one."""
        hits = self._cached_prefix(r)
        return hits, self.allocator.pages_for(r.num_tokens + 1) - len(r.block_table) - len(hits)

    def _looks_up(self, r: Request) -> bool:
        """Whether ``r`` may start with cached pages: prefix caching on, nothing computed, no prompt
        log-probabilities asked for (they need every prompt position's logits)."""
        return (self.prefix_caching and not r.block_table and not r.num_computed
                and r.sampling.prompt_logprobs is None)

    def _prefix_hashes(self, r: Request) -> list[bytes]:
        """The hashes of the full pages ``r`` may find cached (none unless :meth:`_looks_up`): every full page but
        one that would hold its last token."""
        if not self._looks_up(r):
            return []
        usable = (r.num_tokens - 1) // self.allocator.page_size
        return page_hashes(r.all_token_ids, self.allocator.page_size, r.page_hashes, upto=usable,
                           salt=r.cache_salt)[:usable]

    def _cached_prefix(self, r: Request) -> list[int]:
        """The cached pages ``r`` would start with: the longest run of its full pages registered."""
        return self.allocator.lookup(self._prefix_hashes(r))

    def _awaits_prefix(self, r: Request) -> bool:
        """Prefix caching: whether the first page ``r`` would compute is one a running request is still prefilling
        (same tokens from the first): ``r`` waits to share it (admission stops, first come first served) instead of
        computing it beside it. A burst of requests behind one system prompt, or a request's ``n`` choices, computes
        the prefix once; the running request's own chunks come first in every prefill step, so the wait ends. The
        pages a prefilling request will register are all its full pages, the one holding its last prompt token
        included (its own lookup stopped short of that one, so its hashes are extended here)."""
        hashes = self._prefix_hashes(r)
        hits = len(self.allocator.lookup(hashes))
        if hits == len(hashes):
            return False
        page_size = self.allocator.page_size
        return any(
            hashes[hits] in page_hashes(q.all_token_ids, page_size, q.page_hashes,
                                        upto=q.num_tokens // page_size, salt=q.cache_salt)[q.num_registered_pages:]
            for q in self.running if q.is_prefilling and not q.stale_kv)  # (a stale one never registers its pages)

    def _admit(self, r: Request) -> bool:
        hits, needed = self._admission(r)
        if not self.allocator.can_allocate(needed + self.allocator.num_unheld(hits)):
            return False
        self.waiting.popleft()
        if self._looks_up(r):
            self.num_prefix_queries += r.num_tokens
            self.num_prefix_hits += len(hits) * self.allocator.page_size
            if r.num_preemptions == 0:
                r.num_cached_tokens = len(hits) * self.allocator.page_size
        if hits:
            self.allocator.share(hits)
            r.block_table.extend(hits)
            r.num_registered_pages = len(hits)
            r.num_computed = len(hits) * self.allocator.page_size
            # the draft's K/V: the leading hits that hold them are its; it catches up over the rest
            r.num_draft_cached_pages = self.allocator.draft_prefix(hits)
            r.num_draft_computed = r.num_draft_cached_pages * self.allocator.page_size
            self.num_prefix_draft_hits += r.num_draft_computed
        r.block_table.extend(self.allocator.allocate(needed))
        r.status = RequestStatus.RUNNING
        self.running.append(r)
        return True

    def cache_computed(self, r: Request) -> None:
        """Register ``r``'s pages that are full of computed tokens, and mark those its draft has run over as holding
        the draft's K/V (prefix caching on; a no-op otherwise)."""
        if not self.prefix_caching or not r.block_table or r.stale_kv:
            return
        page_size = self.allocator.page_size
        full = min(r.num_computed, r.num_tokens) // page_size
        if full > r.num_registered_pages:
            hashes = page_hashes(r.all_token_ids, page_size, r.page_hashes, upto=full, salt=r.cache_salt)
            for j in range(r.num_registered_pages, full):
                self.allocator.register(r.block_table[j], hashes[j])
            r.num_registered_pages = full
        drafted = min(r.num_registered_pages, r.num_draft_computed // page_size)
        if drafted > r.num_draft_cached_pages:
            self.allocator.mark_draft(r.block_table[r.num_draft_cached_pages:drafted])
            r.num_draft_cached_pages = drafted

    def schedule_decode(self, lookahead: int) -> ScheduledBatch | None:
        preempted: list[Request] = []
        scheduled: list[Request] = []
        candidates = [r for r in self.running if not r.is_prefilling]
        if self.by_priority:  # most urgent first: a victim (the latest in this order) is never one scheduled before
            candidates.sort(key=self._rank)
        for r in candidates:
            if r.status is not RequestStatus.RUNNING:  # preempted below as a victim
                continue
            # Positions written this step: num_computed .. num_tokens - 1 + lookahead, capped at the context limit
            # (speculative positions past it map to the padding page and are never committed).
            capacity = min(r.num_tokens + lookahead, self.max_model_len)
            needed = self.allocator.pages_for(capacity) - len(r.block_table)
            while needed > 0 and not self.allocator.can_allocate(needed):
                victim = max(self.running, key=self._rank) if self.by_priority else self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is r:
                    break
            if r.status is not RequestStatus.RUNNING:
                continue
            if needed > 0:
                r.block_table.extend(self.allocator.allocate(needed))
            scheduled.append(r)
        if not scheduled:
            if preempted:
                return ScheduledBatch("decode", [], [], lookahead, preempted)
            return None
        return ScheduledBatch("decode", scheduled, [1] * len(scheduled), lookahead, preempted or None)

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self._free_pages(r)  # (its computed pages stay cached: its recompute may find them)
        r.num_computed = 0
        r.num_draft_computed = 0
        r.num_preemptions += 1
        r.status = RequestStatus.WAITING
        if self.by_priority:
            self._enqueue(r)
        else:
            self.waiting.appendleft(r)
        self.num_preemptions += 1
        logger.debug("preempted %s (%d tokens)", r.request_id, r.num_tokens)

    def _free_pages(self, r: Request) -> None:
        if r.block_table:
            self.cache_computed(r)
            self.allocator.free(r.block_table)
            r.block_table = []
            r.num_registered_pages = 0
            r.num_draft_cached_pages = 0
            r.stale_kv = False  # (it computes everything again)
