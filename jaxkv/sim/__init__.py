"""The research side: traces, the replay simulator, the bounds, the LP, oracle and learned policies.

  trace      the trace format and the synthetic generators
  simulate   the trace-driven replay simulator (its steps in replay, checks and timing; its
             command in cli)
  oracles    the oracle policies (Page, PaperSA, Unlimited) and the oracle parts of Anneal
             (Oracle and Visits forecasts; BeladyTail, Dual and Overflow terminal values)
  belady     Belady's MIN with bypass as an in-step rule: the attainable limit of a pool
  bounds     the Unlimited, capacity and cache lower bounds
  lp/        the LP relaxation's bound and its dual values (bound; model, lagrangian, dual,
             trace; the method: docs/lp_bound.md)
  learned    the learned (logistic, optax-trained) forecaster

The runtime (`jaxkv` itself: the cache, attention, online policies and the decode loop) imports
nothing from here; this package imports the runtime (its cost model, cache, placement). Importing
it registers its policies (the oracles, Belady, anneal-oracle, the bound) and the anneal knobs
of its parts with the runtime's registry (`jaxkv.placement.registry`, `.presets`).
"""

from jaxkv.sim import belady, learned, oracles  # noqa: F401  (they register policies, knobs)
