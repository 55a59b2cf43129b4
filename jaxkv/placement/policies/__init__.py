"""Placement policies, one a module; every one registers its name in `jaxkv.placement.registry`.

base       the Policy protocol, Observation, PolicyBase and KeepsPlacement
static     Static ("static"): write order, never moves (the paper's)
lrfu       Lrfu ("lrfu"): the live policy, LRFU inside the step, from the prompt's prior
follow     Follow: the in-step rule of lrfu and of anneal+follow (the vector executor)
the field's rules, inside the step, each promotion riding the step's read (the sequential
executor, `jaxkv.placement.admission`):
  lru      Lru ("lru"): the LRU hot buffer (SGLang HiSparse, vLLM offload)
  arc      Arc ("arc"): Adaptive Replacement Cache
  slru     Slru ("slru"): segmented LRU
  lfu      Lfu ("lfu"): LFU with aging
  tinylfu  TinyLfu ("tinylfu"): W-TinyLFU admission (Caffeine)
lru_plan   LruPlan ("lru-plan"): LRU planned every W steps, promotions read over the link again
anneal     Anneal ("anneal" and its modifiers): simulated annealing, composed from parts
anneal_knobs  its flat knobs (`anneal_policy`) and its name's registration
sharing one HBM pool among requests (built as objects: they need the blocks per request):
  lru_quota     LruQuota: a fixed LRU hot buffer per request (SGLang HiSparse)
  anneal_quota  AnnealQuota: quotas per request and layer set by each window's anneal+reuse
                plan, LRU inside each between plans
The simulator's oracles (Belady, page, paper-sa, anneal-oracle, unlimited) are in
`jaxkv.sim` and register from there.
"""

from jaxkv.placement.admission import FOLLOW_ADMITS, follow_moves, follow_value, moves_mask
from jaxkv.placement.policies.anneal import Anneal, AnnealPolicyState
from jaxkv.placement.policies.anneal_knobs import anneal_policy
from jaxkv.placement.policies.arc import Arc
from jaxkv.placement.policies.base import (
    NEVER,
    KeepsPlacement,
    Observation,
    Policy,
    PolicyBase,
    looks_ahead,
    plans,
    rule_of,
    top_capacity,
)
from jaxkv.placement.policies.follow import FOLLOW_ADMITS_DEFAULT, Follow
from jaxkv.placement.policies.lfu import Lfu
from jaxkv.placement.policies.lrfu import Lrfu
from jaxkv.placement.policies.lru import Lru
from jaxkv.placement.policies.lru_plan import LruPlan
from jaxkv.placement.policies.slru import Slru
from jaxkv.placement.policies.static import Static
from jaxkv.placement.policies.tinylfu import TinyLfu

FIELD_RULES = (Lru, Arc, Slru, Lfu, TinyLfu)  # the field's own rules, in the step

__all__ = [
    "FIELD_RULES",
    "FOLLOW_ADMITS",
    "FOLLOW_ADMITS_DEFAULT",
    "NEVER",
    "Anneal",
    "AnnealPolicyState",
    "Arc",
    "Follow",
    "KeepsPlacement",
    "Lfu",
    "Lrfu",
    "Lru",
    "LruPlan",
    "Observation",
    "Policy",
    "PolicyBase",
    "Slru",
    "Static",
    "TinyLfu",
    "anneal_policy",
    "follow_moves",
    "follow_value",
    "looks_ahead",
    "moves_mask",
    "plans",
    "rule_of",
    "top_capacity",
]
