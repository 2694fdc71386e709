"""KV pages: allocation, reference counts and the prefix cache.

The cache holds ``num_blocks`` pages of ``block_size`` token slots. A sequence owns a list of
pages (its block table); token ``t`` of it lives in slot ``table[t // block_size] * block_size +
t % block_size``. Page 0 is reserved: padding rows of a CUDA-graph batch write there.

Prefix sharing: a *full* page is immutable, so it can be shared. Each full page gets a key
``(key of the previous page, its tokens)``; a new sequence whose prompt starts with the same
tokens takes the cached pages (reference count + 1) and computes only the rest. The ``n`` samples
of a group share their prompt's KV: the first sample prefills the prompt, and when it draws its
first token the others waiting for it are forked from it (:meth:`fork`: its full pages shared, its
partial last page copied, their first tokens drawn from its logits), so none of them recomputes
any of the prompt; a sample that could not be forked then (no free slot or page) finds the full
pages in the prefix cache later and recomputes at most the last partial page. A page whose count
drops to 0 stays cached (evictable, least recently used first) until its slot is needed.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from miles_core.rollout.engine_core.request import Request

PageKey = tuple[int, tuple[int, ...]]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref = [0] * num_blocks
        self.key_of: list[PageKey | None] = [None] * num_blocks
        self.cached: dict[PageKey, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached pages with ref 0, LRU first
        self.free: deque[int] = deque(range(1, num_blocks))  # page 0 is the padding page
        self.stale: set[int] = set()  # pages in use at a flush (see :meth:`flush`): never cached
        self.hits = 0  # prompt tokens served from the prefix cache (cumulative)

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    def _take(self) -> int:
        if self.free:
            b = self.free.popleft()
        else:
            b, _ = self.evictable.popitem(last=False)
            del self.cached[self.key_of[b]]
            self.key_of[b] = None
        self.ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.stale.discard(b)
            if self.key_of[b] is not None:
                self.evictable[b] = None
            else:
                self.free.append(b)

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        """New pages ``req`` needs to hold ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(req.block_ids))

    def admit(self, req: Request, num_tokens: int) -> bool:
        """Give a waiting request pages for ``num_tokens`` tokens, reusing cached prefix pages.

        Sets ``req.num_computed`` to the number of tokens found in the cache (always leaving at
        least one token to compute, so the step yields logits). False if memory is short.
        """
        assert not req.block_ids
        ids = req.all_ids[: num_tokens - 1]  # the last token is always computed
        bs = self.block_size
        reuse: list[int] = []
        if self.prefix_caching:
            parent = 0
            for start in range(0, len(ids) - len(ids) % bs, bs):  # full pages only
                key = (parent, tuple(ids[start : start + bs]))
                b = self.cached.get(key)
                if b is None:
                    break
                reuse.append(b)
                parent = hash(key)
        need = -(-num_tokens // bs) - len(reuse)
        reclaimable = sum(1 for b in reuse if self.ref[b] == 0)
        if need > self.num_free - reclaimable:
            return False
        for b in reuse:
            if self.ref[b] == 0:
                del self.evictable[b]
            self.ref[b] += 1
        req.block_ids = reuse + [self._take() for _ in range(need)]
        req.num_computed = req.num_cached = len(reuse) * bs
        self.hits += req.num_cached
        return True

    def fork(self, src: Request, dst: Request, num_tokens: int) -> bool:
        """Give ``dst`` (holding no pages) the pages of ``src``'s first ``num_tokens`` tokens, all
        computed: the full pages shared (reference count + 1), the partial last one, if any, a fresh
        page the caller fills with a copy of ``src``'s. False if memory is short."""
        assert not dst.block_ids
        bs = self.block_size
        full = num_tokens // bs
        tail = 1 if num_tokens % bs else 0
        if tail > self.num_free:
            return False
        for b in src.block_ids[:full]:
            self.ref[b] += 1  # in use by src: not evictable
        dst.block_ids = src.block_ids[:full] + [self._take() for _ in range(tail)]
        self.hits += num_tokens
        return True

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Append pages so ``req`` can hold ``num_tokens`` tokens. False if memory is short."""
        need = self.blocks_needed(req, num_tokens)
        if need > self.num_free:
            return False
        req.block_ids.extend(self._take() for _ in range(need))
        return True

    def commit(self, req: Request) -> None:
        """Register the full pages of ``req`` whose tokens are all computed, for later reuse. A sequence
        holding a page from before a flush registers none: its K/V, and all computed over it, are the old weights'."""
        if not self.prefix_caching or (self.stale and not self.stale.isdisjoint(req.block_ids)):
            return
        ids = req.all_ids
        bs = self.block_size
        parent = 0
        for i in range(req.num_computed // bs):
            key = (parent, tuple(ids[i * bs : (i + 1) * bs]))
            b = req.block_ids[i]
            if self.key_of[b] is None and key not in self.cached:
                self.key_of[b] = key
                self.cached[key] = b
            parent = hash(key)

    def free_request(self, req: Request) -> None:
        for b in reversed(req.block_ids):  # the tail is evicted first
            self._release(b)
        req.block_ids = []

    def flush(self) -> None:
        """Forget every cached prefix (on a weight update). Pages in use stay in use, but are never
        cached: their sequences' K/V were computed with the weights before."""
        for b in list(self.evictable):
            self.free.append(b)
        self.evictable.clear()
        for b in range(self.num_blocks):
            self.key_of[b] = None
            if self.ref[b]:
                self.stale.add(b)
        self.cached.clear()
