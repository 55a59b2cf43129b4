"""Where blocks live: the placement core, the policies, their registry and what they see.

admission    the one in-step core: StepView, Admission, the Rule protocol, admit()
lists        recency lists the field's rules keep (LRU, ARC, SLRU, TinyLFU)
charging     what a step's reads and moves cost: the decode loop's and the paper's rules
policies/    one policy a module: Static, LruPlan (the paper's Reactive), the field's rules
             (Lru, Arc, Slru, Lfu, TinyLfu), Lrfu (the live default), Anneal, Follow
registry     every policy name registered once, with its kind, modifiers and knobs
presets      the front door over the registry: resolve, describe, split a policy list
statistics   per-block read statistics and the online forecasts' math
forecasts    forecaster parts: EMA, Reuse, Now
pricing      pricing terms (LinkReserve, Unforeseen, Ride, Spread) and controllers
observation  what a policy sees at a plan of the decode loop
anneal/      the vectorized annealer
"""
