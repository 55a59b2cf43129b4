"""jaxkv.sim: the research side.

  trace      the trace format and the synthetic generators
  simulate   the trace-driven replay simulator (its steps in replay, checks and timing; its
             command in cli)
  oracles    the oracle policies (Page, PaperSA, Unlimited) and the oracle parts of Anneal
             (Oracle and Visits forecasts; BeladyTail, Dual and Overflow terminal values)
  bounds     the Unlimited, capacity and cache lower bounds
  lp_bound   the LP relaxation's bound and its dual values (lp_model, lp_lagrangian, lp_dual,
             lp_trace; the method: docs/lp_bound.md)
  learned    the learned (logistic, optax-trained) forecaster

The runtime (`jaxkv` itself: the cache, attention, online policies and the decode loop) imports
nothing from here; this package imports the runtime's cost model and policies.
"""
