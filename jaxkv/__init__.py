"""jaxkv: a paged KV cache split over HBM and host memory, with annealed block placement.

The runtime (what a model imports; it never imports `jaxkv.sim`, scipy or optax):
  config        static configs and hardware profiles
  cost          the cost model: step latency, bounds, `CostModel` (what a plan is priced in),
                the one table of model shapes (`ARCHITECTURES`) and their geometries
  cache         TieredKVCache and its pure operations (cache_layout: the pytree; migration:
                plan_moves / migrate; slot_ops: slot-table helpers)
  transfer      reads and writes across memory kinds
  quant         FP8 blocks with per-block, per-KV-head scales (the FP8 host tier)
  attention     tier-aware decode attention (exact and Quest-sparse)
  importance    per-block read statistics and the online forecasts' math
  forecasts     forecaster parts: EMA, Reuse, Now
  pricing       pricing terms (LinkReserve, Unforeseen, Ride, Spread) and controllers
  anneal        the vectorized annealer (anneal_energy: the problem and its energy;
                anneal_init: the greedy start; anneal_moves: moves, their prices and the
                start's certificate of local optimality)
  policies      the Policy protocol, Static, Reactive, Anneal (composed from the parts), Follow
  presets       every policy name, resolved in one place
  decode        the functional decode loop
  model_api     what the decode loop uses of a model (the Model protocol), FunctionalModel
                for models written as plain JAX functions over a params pytree
  sharded       the cache and decode loop on a ("data", "model") mesh, one process or many
  gpu_compile   compiling for a GPU on a machine without one (gpu_analysis: reading its HLO)
  cli           the `jaxkv` command
The research side, `jaxkv.sim`: traces, the replay simulator, the bounds and the LP, the
oracle policies, the learned forecaster (see its docstring).
"""

from jaxkv.model_api import FunctionalModel

__all__ = ["FunctionalModel"]
__version__ = "0.1.0"
