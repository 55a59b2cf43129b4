"""Where blocks live: the policy protocol, statistics, forecasts, pricing, presets, annealer.

policies     the Policy protocol; Static, Reactive (LRU), Lrfu, Anneal (composed), Follow
statistics   per-block read statistics and the online forecasts' math
forecasts    forecaster parts: EMA, Reuse, Now
pricing      pricing terms (LinkReserve, Unforeseen, Ride, Spread) and controllers
presets      every policy name, resolved in one place
observation  what a policy sees at a plan of the decode loop
anneal/      the vectorized annealer
"""
