"""Who runs in the next step: continuous batching with chunked prefill and preemption.

A step is either a *prefill* step (chunks of prompts, at most ``max_batched_tokens`` tokens in all)
or a *decode* window (every running, fully prefilled request advances ``decode_steps`` tokens).
New requests are admitted whenever a sequence row and KV pages are free, so requests join and
leave the running batch at every step (continuous batching, Yu et al., Orca, OSDI 2022). After a
prefill step the next step decodes if anything can, so arrivals never stall running requests for
more than one chunk. A long prompt is prefilled in chunks over several steps (chunked prefill,
Agrawal et al., Sarathi, 2023). When a decode window lacks pages, the most recently admitted
request is preempted: its pages are freed and it is recomputed later from its tokens (vLLM's
recompute preemption), its outputs so far kept.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from miles_core.rollout.engine_core.blocks import BlockManager
from miles_core.rollout.engine_core.config import EngineConfig
from miles_core.rollout.engine_core.request import Request, Status


@dataclass
class PrefillPlan:
    chunks: list[tuple[Request, int]]  # (request, tokens to compute now)


@dataclass
class DecodePlan:
    requests: list[Request]
    steps: int
    preempted: list[Request] = field(default_factory=list)


def prefill_target(req: Request) -> int:
    """Tokens to have in the cache before the request decodes: all of them, or all but the last
    sampled token for a request resumed after preemption (that token is decoded next)."""
    return req.num_tokens - 1 if req.output_ids else req.num_tokens


def final_len(req: Request, max_model_len: int) -> int:
    return min(len(req.prompt_ids) + req.params.max_new_tokens, max_model_len)


class Scheduler:
    def __init__(self, cfg: EngineConfig, blocks: BlockManager, allow_prefix_reuse, max_model_len: int | None = None) -> None:
        self.cfg = cfg
        self.blocks = blocks
        # the engine's limit (cfg.max_model_len capped by the model's positions): windows and pages past it are never used
        self.max_model_len = max_model_len or cfg.max_model_len
        self.allow_prefix_reuse = allow_prefix_reuse  # (request) -> bool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots: list[int] = list(range(cfg.max_num_seqs - 1, -1, -1))
        self.last_was_prefill = False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ admission
    def _ready(self, req: Request) -> bool:
        lead = req.leader
        return lead is None or lead.finished or (lead.status is Status.RUNNING and lead.num_computed >= len(lead.prompt_ids))

    def _admit(self, req: Request) -> bool:
        if not self.free_slots:
            return False
        prefix = self.blocks.prefix_caching
        self.blocks.prefix_caching = prefix and self.allow_prefix_reuse(req)
        try:
            ok = self.blocks.admit(req, prefill_target(req))
        finally:
            self.blocks.prefix_caching = prefix
        if ok:
            req.status = Status.RUNNING
            req.slot = self.free_slots.pop()
            self.running.append(req)
        return ok

    def fork_followers(self, leaders: list[Request]) -> list[Request]:
        """Admit the waiting samples whose group leader is in ``leaders`` (leaders that have just
        computed their whole prompt) onto the leader's prompt pages (:meth:`BlockManager.fork`), as
        far as slots and pages go; they then hold their prompt as computed. Returns them in queue order."""
        lead_ids = {id(r) for r in leaders}
        forked: list[Request] = []
        rest: deque[Request] = deque()
        for req in self.waiting:
            lead = req.leader
            if (lead is not None and id(lead) in lead_ids and not req.output_ids and self.free_slots
                    and self.blocks.fork(lead, req, len(req.prompt_ids))):
                req.num_computed = req.num_cached = len(req.prompt_ids)
                req.status = Status.RUNNING
                req.slot = self.free_slots.pop()
                self.running.append(req)
                forked.append(req)
            else:
                rest.append(req)
        self.waiting = rest
        return forked

    def schedule(self) -> PrefillPlan | DecodePlan | None:
        decodable = [r for r in self.running if r.num_computed >= prefill_target(r)]
        if decodable and self.last_was_prefill:
            self.last_was_prefill = False
            return self._decode(decodable)
        plan = self._prefill()
        if plan is not None:
            self.last_was_prefill = True
            return plan
        self.last_was_prefill = False
        decodable = [r for r in self.running if r.num_computed >= prefill_target(r)]
        return self._decode(decodable) if decodable else None

    def _prefill(self) -> PrefillPlan | None:
        budget = self.cfg.max_batched_tokens
        chunks: list[tuple[Request, int]] = []
        for req in self.running:  # chunks left over from earlier steps go first
            todo = prefill_target(req) - req.num_computed
            if todo > 0 and budget > 0:
                n = min(todo, budget)
                chunks.append((req, n))
                budget -= n
        skipped: list[Request] = []
        while self.waiting and budget > 0:
            req = self.waiting.popleft()
            if not self._ready(req):
                skipped.append(req)
                continue
            if not self._admit(req):
                self.waiting.appendleft(req)
                break
            n = min(prefill_target(req) - req.num_computed, budget)
            chunks.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return PrefillPlan(chunks) if chunks else None

    # ------------------------------------------------------------------ decode
    def _decode(self, reqs: list[Request]) -> DecodePlan:
        # no longer than the longest of the rows still needs (its host state may lag a window in flight: longer, never shorter)
        steps = max(1, min(self.cfg.decode_steps, max(final_len(r, self.max_model_len) - r.num_tokens for r in reqs)))
        preempted: list[Request] = []
        for req in list(reqs):
            if req in preempted:
                continue
            need = min(req.num_tokens - 1 + steps, final_len(req, self.max_model_len) - 1)
            while not self.blocks.grow(req, need):
                victim = next(r for r in reversed(self.running) if r not in preempted)
                self.preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
        return DecodePlan([r for r in reqs if r not in preempted], steps, preempted)

    def preempt(self, req: Request) -> None:
        self.blocks.free_request(req)
        self.running.remove(req)
        self.free_slots.append(req.slot)
        req.slot = -1
        req.num_computed = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        if req.status is Status.RUNNING:
            self.blocks.commit(req)
            self.blocks.free_request(req)
            self.running.remove(req)
            self.free_slots.append(req.slot)
            req.slot = -1
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
