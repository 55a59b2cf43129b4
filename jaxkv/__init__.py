"""jaxkv: a paged KV cache split over HBM and host memory, with annealed block placement.

The public API is importable from here: `Decoder`, `DecodeState`, `summarize`, the configs
(`CacheConfig`, `PlacementConfig`, `HardwareProfile`), `TieredKVCache` and `FunctionalModel`.

The rooms of the runtime (what a model imports; it never imports `jaxkv.sim`, scipy or optax,
nor the `models` package):
  config      static configs and hardware profiles
  cost        the cost model: step latency, bounds, `CostModel` (what a plan is priced in),
              the one table of model shapes (`ARCHITECTURES`) and their geometries
  model_api   what the decode loop uses of a model (the Model protocol), `FunctionalModel`
  cache/      the tiered KV cache: its pytree, operations, migration, transfers, FP8 blocks
  attention/  tier-aware decode attention: block selection, the XLA path, the tiered merge
  placement/  where blocks live: the Policy protocol, statistics, forecasts, pricing, presets,
              a plan's observation, and the annealer (`placement/anneal/`)
  decode/     the functional decode loop: decoder, state, set-up, the in-step admission rule,
              sampling, and the sharded decoder
  gpu/        compiling for a GPU on a machine without one, and reading its HLO
  cli         the `jaxkv` command
The research side, `jaxkv.sim/`: traces, the replay simulator, the bounds and the LP
(`sim/lp/`), the oracle policies, the learned forecaster (see its docstring).
"""

from jaxkv.cache.layout import TieredKVCache
from jaxkv.config import CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.decode.decoder import Decoder
from jaxkv.decode.sampling import Greedy, Sampling
from jaxkv.decode.state import DecodeState, summarize
from jaxkv.model_api import FunctionalModel

__all__ = [
    "CacheConfig",
    "DecodeState",
    "Decoder",
    "FunctionalModel",
    "Greedy",
    "HardwareProfile",
    "PlacementConfig",
    "Sampling",
    "TieredKVCache",
    "summarize",
]
__version__ = "0.1.0"
