"""The serving engine: continuous batching on the tiered cache.

Requests with their own sampling parameters enter a FIFO queue, are prefilled in bounded
chunks between decode steps, inserted into free slots of one compiled decode step over a fixed
number of slots, and leave when they finish, their blocks freed in both tiers at once; the host
tier is a pool of pages the running requests share, and when it runs out the newest request is
preempted and recomputed later. docs/serving.md describes it.

engine    `Engine` (submit, step, cancel, stream, generate, close) and its `Event`s: the host
          side, the queue, admission, preemption
core      `EngineCore`: the compiled functions (prefill chunk, insert, release, the decode step)
prefill   the chunked prefill, through the model's own decode_step
sampling  per-slot sampling (temperature, top-k, top-p, seed, stop tokens, budget)
params    `SamplingParams` and the checks a request passes at submit
state     `EngineState`, `StepOut`, `PrefillBuffer`
timing    a run's log priced on a hardware profile and a model's sizes: throughput, TTFT, TPOT

The runtime imports neither `jaxkv.sim` nor the `models` package.
"""

from jaxkv.serve.engine import Engine, Event
from jaxkv.serve.params import SamplingParams

__all__ = ["Engine", "Event", "SamplingParams"]
