"""jaxkv.sim: the research side. Traces and their generators (`trace`), the trace-driven replay
simulator (`simulate`, its command `cli`), the lower bounds (`bounds`: Unlimited, capacity,
cache; `lp_bound`: the LP relaxation and its dual values), the oracle policies and forecasts
(`oracles`), and the learned forecaster (`learned`, optax).

The runtime (`jaxkv` itself: the cache, attention, online policies and the decode loop) imports
nothing from here; this package imports the runtime's cost model and policies.
"""
