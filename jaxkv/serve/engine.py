"""`Engine`: continuous batching on the tiered cache.

Requests are submitted with their own sampling parameters (`submit`) and wait in a FIFO queue.
Each `step` of the engine (an iteration) does, in order:

1. admission: when no prompt is being prefilled, the queue's head starts its prefill if a slot
   is free and the host pool's free pages can hold its prompt plus its max_new_tokens (vLLM's
   rule: the running requests' future growth is not reserved); otherwise it waits, and so
   does the queue behind it (no request overtakes another);
2. one prefill chunk of at most `chunk` tokens of that prompt (`jaxkv.serve.prefill`); after
   its last chunk the request is inserted into its slot as soon as the free pages hold its
   prompt, and its first token comes out;
3. the decode step of every running request (one compiled step over the fixed slots,
   `jaxkv.serve.core`): before it, if the blocks that seal at this step need more host pages
   than are free, the newest running request is preempted (its blocks freed, the request
   requeued at the head of the queue, its prompt and tokens recomputed by a later prefill);
   after it, each request's new token, and the finished requests' blocks freed at once.

`step` returns what happened as `Event`s. `stream` iterates over one request's tokens while
stepping the engine; `generate` runs a list of prompts to the end. Every iteration is recorded
(`Engine.log`) so that `jaxkv.serve.timing` can price the run on a hardware profile and model
size after the fact: throughput, TTFT and TPOT, modeled and on the wall.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import cache as kvc
from jaxkv.cache.rows import passed_window
from jaxkv.config import CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.decode.sampling import eos_ids
from jaxkv.model_api import check_model
from jaxkv.serve.core import EngineCore
from jaxkv.serve.params import SamplingParams, check_request, pages_needed
from jaxkv.serve.sampling import REASONS, row_of

WAITING, PREFILLING, RUNNING, FINISHED = "waiting", "prefilling", "running", "finished"


@dataclasses.dataclass(frozen=True)
class Event:
    """What one engine step did to one request: the tokens it produced (the stop token
    included), and whether it finished and why ("stop", "length", "cancelled",
    "nonfinite")."""

    request_id: int
    tokens: tuple[int, ...] = ()
    finished: bool = False
    reason: str | None = None


@dataclasses.dataclass
class Request:
    """A request's host-side record (mutable, the engine's)."""

    id: int
    prompt: np.ndarray  # [T] int32
    params: SamplingParams
    submitted: int  # the iteration at which it was submitted (`Engine.iteration`)
    submitted_wall: float
    status: str = WAITING
    tokens: list = dataclasses.field(default_factory=list)
    token_iters: list = dataclasses.field(default_factory=list)  # iteration of each token
    token_wall: list = dataclasses.field(default_factory=list)
    reason: str | None = None
    slot: int | None = None
    admitted: int = -1  # admission order (the newest running request is preempted first)
    preemptions: int = 0

    @property
    def recompute(self) -> np.ndarray:
        """What a prefill of this request computes: its prompt and every token it produced
        but the last (which is the next input)."""
        return np.concatenate([self.prompt, np.asarray(self.tokens[:-1], np.int32)])


@dataclasses.dataclass
class Iteration:
    """One engine step, as the log keeps it for pricing (`jaxkv.serve.timing`)."""

    chunk: int = 0  # prompt tokens prefilled
    chunk_start: int = 0  # position of the chunk's first token in its prompt
    inserted: int = 0  # tokens of the prompt inserted into a slot (its host pages written)
    decoded: int = 0  # tokens the decode step produced (0: no decode step)
    window: bool = False  # the decode step ended a window (a plan)
    out: dict | None = None  # the decode step's `StepOut`, on the host
    wall_chunk: float = 0.0
    wall_step: float = 0.0
    preempted: int = 0


class Engine:
    """Continuous batching over a tiered KV cache (module docstring).

    Args:
      model: the model (`jaxkv.model_api`: a `models.Llama`, an NNX module, a
        `FunctionalModel`); params: its parameters (`nnx.split(model)[1]`).
      cache_config: the cache; its `batch` is the number of slots (requests decoded
        together), `max_len` a slot's longest request (prompt + max_new_tokens), the HBM
        capacity one pool shared by every slot, the host capacity (`host_*`, default every
        slot at max_len) one pool of pages shared by every request (`paged_host` is set).
      placement: attention mode and placement policy (`PlacementConfig`).
      profile: the hardware profile of the modeled step latency (a name or a profile).
      eos_id: the model's stop token(s), every request's default `stop_ids`.
      chunk: tokens a prefill chunk takes at most (a long prompt takes several steps).
      hbm_quota: HBM blocks per layer a request's prompt may take at insert (None: any free
        slot); after the insert the policy's in-step rule and plans place blocks over the one
        shared pool, quota or not.
      impl, ema_decay, policy_kwargs: as `jaxkv.Decoder`'s.
      check: check the cache's invariants (and the host's page count) after every step
        (slow; for tests).
    """

    def __init__(
        self,
        model,
        params,
        cache_config: CacheConfig,
        placement: PlacementConfig = PlacementConfig(),
        *,
        profile: HardwareProfile | str = "h200-pcie",
        eos_id=None,
        chunk: int = 256,
        hbm_quota: int | None = None,
        impl: str = "auto",
        ema_decay: float = 0.9,
        policy_kwargs: dict | None = None,
        check: bool = False,
    ):
        mc = check_model(model)
        c = _engine_cache(cache_config)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk={chunk!r}: expected an int >= 1 (tokens a prefill chunk)")
        if hbm_quota is not None and (
            isinstance(hbm_quota, bool) or not isinstance(hbm_quota, int) or hbm_quota < 0
        ):
            raise ValueError(f"hbm_quota={hbm_quota!r}: expected None or an int >= 0")
        self.core = EngineCore(
            model, c, placement, chunk=chunk, profile=profile, impl=impl,
            ema_decay=ema_decay, policy_kwargs=policy_kwargs, hbm_quota=hbm_quota,
        )  # fmt: skip
        self.params = params
        self.model_config = mc
        self.eos = eos_ids(eos_id, mc.vocab_size) or ()
        self.context = int(getattr(mc, "max_seq_len", c.max_len))
        self.check = check
        self.state = self.core.init(jax.random.key(0))
        self.buffer = self.core.empty_buffer()
        self.requests: dict[int, Request] = {}
        self.queue: collections.deque[int] = collections.deque()
        self.slots: list[int | None] = [None] * c.batch
        self.lengths = np.zeros((c.batch,), np.int64)  # tokens in each slot's cache row
        self.prefilling: int | None = None  # the request whose prompt is being prefilled
        self.prefill_slot: int | None = None
        self.prefill_done = 0
        self.iteration = 0
        self.log: list[Iteration] = []
        self.preemptions = 0
        self._next_id = 0
        self._admitted = 0
        self._pending: list[Event] = []
        self._closed = False
        self._window = (0, int(self.state.decode.placement.window))  # (since_plan, W)

    # ---- the API -------------------------------------------------------------------------------

    @property
    def cache_config(self) -> CacheConfig:
        return self.core.cache_config

    @property
    def pages(self) -> int:
        """Host pages in the pool (`CacheConfig.host_slots`)."""
        return self.cache_config.host_slots

    @property
    def free_pages(self) -> int:
        """Host pages no running request holds (the host's count)."""
        bs, slots = self.cache_config.block_size, self.slots
        w = passed_window(self.core.windows)
        held = [pages_needed(n, bs, w) for b, n in enumerate(self.lengths) if slots[b] is not None]
        return self.pages - sum(held)

    def submit(self, prompt_ids, params: SamplingParams | None = None) -> int:
        """Queues a request (`prompt_ids` [T] token ids) and returns its id. ValueError, before
        anything is queued, for an empty prompt, ids outside the vocabulary, bad sampling
        values (`SamplingParams`), unknown stop ids, or a request longer than the model's
        context, a slot or the whole host pool; RuntimeError after `close`."""
        if self._closed:
            raise RuntimeError("submit: the engine is closed: create a new Engine")
        params = SamplingParams() if params is None else params
        c = self.cache_config
        ids = check_request(
            prompt_ids, params, vocab_size=self.model_config.vocab_size, max_len=c.max_len,
            context=self.context, pages=self.pages, block_size=c.block_size,
        )  # fmt: skip
        rid = self._next_id
        self._next_id += 1
        self.requests[rid] = Request(rid, ids, params, self.iteration, time.perf_counter())
        self.queue.append(rid)
        return rid

    def cancel(self, request_id: int) -> bool:
        """Cancels a request: waiting, being prefilled or running (its blocks are freed now).
        Returns False when it had finished already; KeyError for an id never submitted. The
        next `step` reports it finished with reason "cancelled"."""
        if request_id not in self.requests:
            raise KeyError(f"cancel: no request {request_id!r} was submitted to this engine")
        r = self.requests[request_id]
        if r.status == FINISHED:
            return False
        if r.status == WAITING:
            self.queue.remove(request_id)
        elif r.status == PREFILLING:
            self.prefilling, self.prefill_slot = None, None
        elif r.status == RUNNING:
            self._free_slot(r.slot)
        self._finish(r, "cancelled")
        self._pending.append(Event(request_id, finished=True, reason="cancelled"))
        return True

    def step(self) -> list[Event]:
        """One iteration (module docstring): admission, a prefill chunk, a decode step.
        Returns the events, one per request that produced tokens or finished."""
        if self._closed:
            raise RuntimeError("step: the engine is closed")
        it = Iteration()
        events: dict[int, Event] = {}
        for e in self._pending:
            events[e.request_id] = e
        self._pending = []
        self._admit()
        if self.prefilling is not None:
            self._prefill_chunk(it, events)
        if any(s is not None and self.requests[s].status == RUNNING for s in self.slots):
            self._decode(it, events)
        self.log.append(it)
        self.iteration += 1
        return list(events.values())

    @property
    def idle(self) -> bool:
        """No request waiting, being prefilled or running."""
        return not self.queue and self.prefilling is None and all(s is None for s in self.slots)

    def stream(self, prompt_ids, params: SamplingParams | None = None) -> Iterator[int]:
        """Submits a request and yields its tokens as the engine produces them, stepping the
        engine (every other request advances too)."""
        rid = self.submit(prompt_ids, params)
        r = self.requests[rid]
        seen = 0
        while True:
            while seen < len(r.tokens):
                seen += 1
                yield r.tokens[seen - 1]
            if r.status == FINISHED:
                return
            self.step()

    def generate(
        self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Runs `prompts` (each [T] token ids) to the end, all submitted at once, and returns
        each one's tokens."""
        many = isinstance(params, list | tuple)
        ids = [self.submit(p, params[i] if many else params) for i, p in enumerate(prompts)]
        while not all(self.requests[i].status == FINISHED for i in ids):
            self.step()
        return [list(self.requests[i].tokens) for i in ids]

    def close(self) -> None:
        """Cancels every request and drops the device state; `submit` then refuses."""
        if self._closed:
            return
        for rid in [r.id for r in self.requests.values() if r.status != FINISHED]:
            self.cancel(rid)
        self._closed = True
        self.state = None
        self.buffer = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the iteration's parts -------------------------------------------------------------------

    def _admit(self) -> None:
        """The queue's head starts its prefill when no other prompt is being prefilled, a
        slot is free and the free pages hold its prompt plus its max_new_tokens."""
        if self.prefilling is not None or not self.queue:
            return
        free = [b for b, s in enumerate(self.slots) if s is None]
        if not free:
            return
        r = self.requests[self.queue[0]]
        bs = self.cache_config.block_size
        need = pages_needed(len(r.prompt) + r.params.max_new_tokens - 1, bs)
        if need > self.free_pages:
            return
        self.queue.popleft()
        r.status = PREFILLING
        self.prefilling, self.prefill_slot, self.prefill_done = r.id, free[0], 0
        tokens = r.recompute
        buf = np.zeros(self.buffer.tokens.shape, np.int32)
        buf[: len(tokens)] = tokens
        self.buffer = dataclasses.replace(self.buffer, tokens=jnp.asarray(buf))

    def _prefill_chunk(self, it: Iteration, events: dict) -> None:
        """One chunk of the prompt being prefilled; after its last, the insert (when the free
        pages hold the prompt)."""
        r = self.requests[self.prefilling]
        total = len(r.recompute)
        if self.prefill_done < total:
            n = min(self.core.chunk, total - self.prefill_done)
            t0 = time.perf_counter()
            self.buffer = self.core.chunk_step(
                self.params, self.buffer, jnp.int32(self.prefill_done), jnp.int32(n)
            )
            jax.block_until_ready(self.buffer.logits)
            it.wall_chunk = time.perf_counter() - t0
            it.chunk, it.chunk_start = n, self.prefill_done
            self.prefill_done += n
        if self.prefill_done < total:
            return
        if pages_needed(total, self.cache_config.block_size) > self.free_pages:
            return  # the running requests hold the pages: insert when they free some
        self._insert(r, total, it, events)

    def _insert(self, r: Request, total: int, it: Iteration, events: dict) -> None:
        b = self.prefill_slot
        self.prefilling, self.prefill_slot = None, None
        produced = len(r.tokens)
        resume = r.tokens[-1] if produced else 0
        row = row_of(r.params, self.eos)
        t0 = time.perf_counter()
        self.state, first, reason = self.core.insert(
            self.params, self.state, self.buffer, jnp.int32(b), jnp.int32(total), row,
            jnp.int32(produced), jnp.int32(resume),
        )  # fmt: skip
        first, reason = int(first), int(reason)
        it.wall_chunk += time.perf_counter() - t0
        it.inserted = total
        r.status, r.slot = RUNNING, b
        r.admitted = self._admitted
        self._admitted += 1
        self.slots[b] = r.id
        self.lengths[b] = total
        if not produced:  # a new request's first token
            r.tokens.append(first)
            r.token_iters.append(self.iteration)
            r.token_wall.append(time.perf_counter())
            self._event(events, r.id, [first])
        if reason:
            self._free_slot(b)
            self._finish(r, REASONS[reason])
            self._event(events, r.id, [], REASONS[reason])
        if self.check:
            self._check()

    def _decode(self, it: Iteration, events: dict) -> None:
        """The pages the step's sealing blocks need (preempting the newest request while they
        are short), the decode step, its tokens and finished requests."""
        bs = self.cache_config.block_size
        while True:
            running = [b for b, s in enumerate(self.slots) if s is not None]
            sealing = sum(1 for b in running if (self.lengths[b] + 1) % bs == 0)
            if sealing <= self.free_pages or len(running) <= 1:
                break
            newest = max(running, key=lambda b: self.requests[self.slots[b]].admitted)
            self._preempt(newest)
            it.preempted += 1
        if not any(s is not None for s in self.slots):
            return
        since, window = self._window
        plan = since + 1 >= window
        fn = self.core.window_step if plan else self.core.step
        t0 = time.perf_counter()
        self.state, out = fn(self.params, self.state)
        out = jax.device_get(out)
        it.wall_step = time.perf_counter() - t0
        now = time.perf_counter()
        self._window = (int(out.since_plan), int(out.window))
        it.window = plan
        it.out = {k: np.asarray(getattr(out, k)) for k in out.__dataclass_fields__}
        it.decoded = int((out.tokens >= 0).sum())
        for b, rid in enumerate(self.slots):
            if rid is None or not out.active[b]:
                continue
            self.lengths[b] += 1
            r = self.requests[rid]
            tok = int(out.tokens[b])
            if tok >= 0:
                r.tokens.append(tok)
                r.token_iters.append(self.iteration)
                r.token_wall.append(now)
                self._event(events, rid, [tok])
            reason = int(out.reason[b])
            if reason:
                self._free_slot(b)
                self._finish(r, REASONS[reason])
                self._event(events, rid, [], REASONS[reason])
        if self.check:
            self._check()

    def _preempt(self, b: int) -> None:
        """The request in slot `b` back to the head of the queue, its blocks freed; a later
        prefill recomputes its prompt and tokens."""
        r = self.requests[self.slots[b]]
        self._free_slot(b)
        r.status, r.slot = WAITING, None
        r.preemptions += 1
        self.preemptions += 1
        self.queue.appendleft(r.id)

    def _free_slot(self, b: int) -> None:
        self.state = self.core.release(self.state, jnp.int32(b))
        self.slots[b] = None
        self.lengths[b] = 0

    def _finish(self, r: Request, reason: str) -> None:
        r.status, r.reason, r.slot = FINISHED, reason, None

    def _event(self, events: dict, rid: int, tokens: list, reason: str | None = None) -> None:
        e = events.get(rid, Event(rid))
        events[rid] = Event(
            rid, e.tokens + tuple(tokens), e.finished or reason is not None, reason or e.reason
        )

    def _check(self) -> None:
        """The cache's invariants, and the host's count of the pages against the cache's."""
        cache = self.state.decode.cache
        kvc.check_invariants(cache, windows=self.core.windows)
        lengths = np.asarray(cache.lengths)
        assert (lengths == self.lengths).all(), (lengths, self.lengths)
        free = int(np.asarray(cache.host_free[0]).sum())
        assert free == self.free_pages, (free, self.free_pages)


def _engine_cache(c: CacheConfig) -> CacheConfig:
    """The engine's cache: `c` with its host copies paged (`paged_host`); ValueError for a
    cache the engine does not run (an exclusive host tier, an unpinned host tier, fp8="age")."""
    if not isinstance(c, CacheConfig):
        raise TypeError(f"cache_config: expected a CacheConfig, got a {type(c).__name__}")
    if not c.write_through:
        raise ValueError(
            "Engine: host_tier='exclusive' is not served: the engine keeps every admitted "
            "request's KV on host (write-through) in pages shared by the requests"
        )
    if c.host_memory_kind == "unpinned_host":
        raise ValueError("Engine: host_memory_kind='unpinned_host' is not served (pinned_host is)")
    if c.fp8 == "age":
        raise ValueError("Engine: fp8='age' is not served yet: use fp8='off' or 'host'")
    return c if c.paged_host else dataclasses.replace(c, paged_host=True)
