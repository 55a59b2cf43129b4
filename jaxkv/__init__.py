"""jaxkv: a paged KV cache split over HBM and host memory, with annealed block placement.

Modules: config (static configs and hardware profiles), cache (TieredKVCache and its pure
operations), attention (tier-aware decode attention), decode (the functional decode loop),
policies / anneal / importance / cost (placement), trace / simulate (trace-driven simulation),
cli (the `jaxkv` command).
"""

__version__ = "0.1.0"
