"""The paper's latency model (docs/paper.md): a step reads both tiers in parallel, costs the slower.

Per (decode step, layer):
  T_hbm  = (weights + HBM-resident reads + the new token's write + HBM-side migration) / B_hbm
  T_link = (host-resident reads + link-side migration) / B_link
  step   = max(T_hbm, T_link)

Migration accounting (used by the simulator and the annealer alike): moving one block either way
costs its bytes once on each side (a promotion reads it over the link and writes it to HBM; a
demotion reads it from HBM and writes it over the link), charged to the first step of the window
in which the move happens.

The Unlimited bound (docs/paper.md, calibration) splits every step's bytes between the tiers at the
ideal ratio, never migrates and has no capacity limit:
  step = max((weights + write) / B_hbm, (reads + weights + write) / (B_hbm + B_link)).
No placement beats it: with a = HBM bytes >= weights + write and a + b >= all bytes,
max(a / B_hbm, b / B_link) >= (a + b) / (B_hbm + B_link).

Every function broadcasts, so it is vectorized over steps, layers and candidate assignments.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.config import PROFILES, HardwareProfile, check_number


def layer_step_time(
    hbm_read_bytes,
    host_read_bytes,
    *,
    profile: HardwareProfile,
    weight_bytes=0.0,
    hbm_write_bytes=0.0,
    hbm_migration_bytes=0.0,
    link_migration_bytes=0.0,
):
    """Modeled time of one (step, layer): max(T_hbm, T_link), elementwise over any shape.

    Args:
      hbm_read_bytes: KV bytes read from HBM.
      host_read_bytes: KV bytes read from host memory over the link.
      profile: bandwidths.
      weight_bytes: the layer's weights, always read from HBM.
      hbm_write_bytes: bytes written to HBM (the new token's K and V).
      hbm_migration_bytes, link_migration_bytes: migration traffic charged to each side.
    Returns:
      seconds, broadcast shape of the inputs.
    """
    t_hbm = (
        jnp.asarray(hbm_read_bytes, jnp.float32)
        + weight_bytes
        + hbm_write_bytes
        + hbm_migration_bytes
    ) / profile.hbm_bandwidth
    t_link = (
        jnp.asarray(host_read_bytes, jnp.float32) + link_migration_bytes
    ) / profile.link_bandwidth
    return jnp.maximum(t_hbm, t_link)


def step_bytes(
    *,
    weight_bytes,
    hbm_read_bytes,
    host_read_bytes,
    write_bytes=0.0,
    summary_bytes=0.0,
) -> dict:
    """The bytes one decode step (or layer) touches in the model's accounting, by part; every
    argument broadcasts, "total" sums the parts.

    What `layer_step_time` charges (weights, KV read from each tier, the new token's write)
    plus two HBM-side parts it leaves out, which the program moves as well (measured against
    XLA's cost analysis of the compiled H200 step, bench/RESULTS.md section 7):
      staged   2 x host_read_bytes: every host block a step reads is written into the device
               staging pool and read there by attention (both attention paths stage);
      summary  the sparse selection's reads of the per-block key bounds (`summary_bytes`:
               kmin and kmax, float32, of every live block; 0 in exact mode).
    Both are HBM traffic; a step bound by the link does not wait on them (at the h200-pcie
    ratio, 87 HBM bytes per link byte, staging adds 2.3% of the link time to T_hbm).
    """
    parts = dict(
        weights=jnp.asarray(weight_bytes, jnp.float32),
        hbm_read=jnp.asarray(hbm_read_bytes, jnp.float32),
        host_read=jnp.asarray(host_read_bytes, jnp.float32),
        write=jnp.asarray(write_bytes, jnp.float32),
        staged=2.0 * jnp.asarray(host_read_bytes, jnp.float32),
        summary=jnp.asarray(summary_bytes, jnp.float32),
    )
    parts["total"] = sum(parts.values())
    return parts


def unlimited_step_time(
    read_bytes, *, profile: HardwareProfile, weight_bytes=0.0, hbm_write_bytes=0.0
):
    """The Unlimited-HBM bound of one (step, layer), elementwise over any shape.

    Args:
      read_bytes: KV bytes the step reads (any shape, e.g. [steps, layers]).
      profile: bandwidths.
      weight_bytes: the layer's weights (HBM side only).
      hbm_write_bytes: the new token's K and V (HBM side only).
    Returns:
      seconds, shape of `read_bytes`.
    """
    fixed = jnp.asarray(weight_bytes, jnp.float32) + hbm_write_bytes
    total = jnp.asarray(read_bytes, jnp.float32) + fixed
    return jnp.maximum(
        fixed / profile.hbm_bandwidth, total / (profile.hbm_bandwidth + profile.link_bandwidth)
    )


def capacity_bound_step_time(
    read_bytes, capacity_bytes, *, profile: HardwareProfile, weight_bytes=0.0, hbm_write_bytes=0.0
):
    """Per-step bound when at most `capacity_bytes` of the reads can be HBM-resident.

    Placement re-chosen for free before every step (no migration cost), so no policy beats it;
    it is tighter than `unlimited_step_time` when the HBM budget is below the ideal split.

    Args:
      read_bytes: KV bytes read per (step, layer), any shape.
      capacity_bytes: HBM pool bytes per layer (broadcasts against `read_bytes`).
      profile, weight_bytes, hbm_write_bytes: as in `unlimited_step_time`.
    Returns:
      seconds, shape of `read_bytes`.
    """
    read = jnp.asarray(read_bytes, jnp.float32)
    fixed = jnp.asarray(weight_bytes, jnp.float32) + hbm_write_bytes
    bh, bl = profile.hbm_bandwidth, profile.link_bandwidth
    # The ideal HBM share of the reads; where it fits in [0, min(read, capacity)] the step takes
    # the Unlimited bound's time, else the split at the nearer end. (The value is computed
    # from each case's own formula, not from read - ideal: where the link is 10^4 times slower
    # than HBM that difference cancels in float32 and the bound came out 0.04% too high.)
    ideal = (read + fixed) * bh / (bh + bl) - fixed
    top = jnp.minimum(read, jnp.asarray(capacity_bytes, jnp.float32))
    at_top = layer_step_time(
        top, read - top, profile=profile, weight_bytes=weight_bytes, hbm_write_bytes=hbm_write_bytes
    )
    none = layer_step_time(
        jnp.zeros_like(read), read, profile=profile, weight_bytes=weight_bytes,
        hbm_write_bytes=hbm_write_bytes,
    )  # fmt: skip
    inside = unlimited_step_time(
        read, profile=profile, weight_bytes=weight_bytes, hbm_write_bytes=hbm_write_bytes
    )
    return jnp.where(ideal >= top, at_top, jnp.where(ideal <= 0.0, none, inside))


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Model geometry for the cost model: what one decode step reads.

    Attributes:
      name: preset name (or the recording model's, for a trace's own geometry).
      num_layers, kv_heads, head_dim: KV geometry.
      dtype_bytes: bytes per K or V element.
      weight_bytes: weight bytes read per layer per decode step (HBM side).
      param_bytes: all parameter bytes resident in HBM (reduces the KV budget).
      batch: sequences decoding together, each reading the same blocks (a modeled batch of
        identical sequences, `batched`): a step reads (and writes, and migrates) the KV of
        every one, its weights once; `token_bytes` counts the batch's sequences, so every byte
        count and pool size derived from it (`hbm_capacity_tokens`, `pool_capacity`, the
        simulator's `Setup`, its bounds) is the batch's.
    """

    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    weight_bytes: float
    param_bytes: float
    batch: int = 1

    @property
    def token_bytes(self) -> int:
        """K and V bytes of one token position in one layer, over the batch's sequences."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes * self.batch

    def hbm_capacity_tokens(self, hbm_budget_bytes: float) -> int:
        """KV tokens per layer (per sequence of the batch) that fit in HBM: (budget - params) /
        (layers x token bytes)."""
        kv = hbm_budget_bytes - self.param_bytes
        if kv <= 0:
            raise ValueError(
                f"HBM budget {hbm_budget_bytes / 1e9:.1f} GB leaves no room for KV after "
                f"{self.param_bytes / 1e9:.1f} GB of parameters: "
                f"expected > {self.param_bytes / 1e9:.1f} GB"
            )
        return int(kv // (self.num_layers * self.token_bytes))


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A Llama-class model's shape, the one table of the models jaxkv measures on: a cost
    `Geometry` is derived from it (`geometry`), and the benchmarks build random-weight models
    of it (`llama_fields`, the `models.llama.LlamaConfig` fields).

    Attributes:
      name: the table's key.
      num_layers, dim, num_heads, num_kv_heads, head_dim, ffn_dim, vocab_size, rope_theta: the
        decoder's shape (grouped-query attention, a gated MLP of width ffn_dim).
      params: the published parameter count, embeddings and LM head included.
      tie_embeddings: the LM head is the embedding.
    """

    name: str
    num_layers: int
    dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float
    params: float
    tie_embeddings: bool = False

    @property
    def layer_params(self) -> int:
        """Parameters of one layer's matrices: q and o (dim x heads x head_dim each), k and v
        (dim x kv heads x head_dim each) and the gated MLP (3 x dim x ffn_dim); norms left out."""
        d = self.dim
        q = d * self.num_heads * self.head_dim
        kv = d * self.num_kv_heads * self.head_dim
        return 2 * q + 2 * kv + 3 * d * self.ffn_dim

    def llama_fields(self) -> dict:
        """The `models.llama.LlamaConfig` fields of this shape (the caller adds dtype, length)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del out["name"], out["params"]
        if not self.tie_embeddings:  # LlamaConfig's default
            del out["tie_embeddings"]
        return out

    def geometry(self, dtype_bytes: int = 2) -> Geometry:
        """The cost model's geometry of this shape with weights and KV of `dtype_bytes` bytes:
        a step reads each layer's matrices (`layer_params`); every parameter takes HBM."""
        return Geometry(
            self.name,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            dtype_bytes,
            float(dtype_bytes) * self.layer_params,
            float(dtype_bytes) * self.params,
        )


ARCHITECTURES: dict[str, Architecture] = {
    # Llama-3.1-8B: GQA 8 KV heads x 128 (4 KiB per token-layer in bf16), 218M parameters per
    # layer, 8.03B in all
    "llama3-8b": Architecture("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 500000.0, 8.03e9),
    # Llama-3.1-70B (the seed article's 256k claim, bench/seed_table.py): 80 layers, GQA 8 x 128
    "llama3-70b": Architecture("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 500000.0, 70.6e9),
    # SmolLM2-135M-Instruct, the real model (`models.named`, "smollm2"): GQA 3 KV heads x 64,
    # tied embeddings, 134,515,008 parameters
    "smollm2-135m": Architecture(
        "smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, 100000.0, 134515008.0, True
    ),
}
GEOMETRIES: dict[str, Geometry] = {
    # 436 MB of weights read per layer and step in bf16, about 16 GB of parameters in all
    "llama3-8b": ARCHITECTURES["llama3-8b"].geometry(2),
    # bf16, as deployed (the demo runs it in float32: a trace records its own geometry)
    "smollm2-135m": ARCHITECTURES["smollm2-135m"].geometry(2),
    # The paper's own accounting (docs/paper.md, calibration): d = 4096, 16 KiB per token-layer,
    # W = 4 d^2 * 2 + 2 d d_ff * 2 / 8 bytes per layer; HBM capacity = HBM - 2 x params (16 GB).
    "paper": Geometry(
        "paper", 32, 32, 128, 2, 4 * 4096 * 4096 * 2 + 2 * 4096 * 14000 * 2 / 8, 16e9
    ),
}
PAPER_HBM_BUDGET = 24e9  # the paper's HBM left for the study, bytes in all


def get_geometry(name: str) -> Geometry:
    """Returns a geometry preset; unknown names raise ValueError listing the valid ones."""
    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r}; expected one of {sorted(GEOMETRIES)}")
    return GEOMETRIES[name]


def batched(geometry: Geometry, batch: int) -> Geometry:
    """`geometry` with `batch` sequences decoding together (see `Geometry.batch`): per step the
    KV bytes scale by `batch`, the weights do not, and the pool a budget leaves holds `batch`
    sequences' blocks. Raises ValueError unless batch is an integer >= 1."""
    check_number("batch", batch, integer=True, low=1)
    return geometry if geometry.batch == batch else dataclasses.replace(geometry, batch=batch)


def paper_unlimited_seconds(
    sparsity: float,
    *,
    geometry: Geometry | None = None,
    profile: HardwareProfile | None = None,
    prompt_len: int = 31_299,
    steps: int = 10_239,
) -> float:
    """The Unlimited bound for the paper's workload: reads are the top (1 - s) of the context.

    Args:
      sparsity: s in [0, 1).
      geometry: defaults to the `paper` preset.
      profile: defaults to `gh200-paper`.
      prompt_len, steps: the NarrativeQA sample's shape.
    Returns:
      total decode seconds over all steps and layers.
    """
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must lie in [0, 1), got {sparsity!r}")
    from jaxkv.config import HardwareProfile as HP

    geometry = geometry or GEOMETRIES["paper"]
    profile = profile or HP.preset("gh200-paper")
    ctx = (
        prompt_len + jnp.arange(steps, dtype=jnp.float32) + 1.0
    )  # [steps] tokens incl. the new one
    reads = jnp.ceil((1.0 - sparsity) * ctx) * geometry.token_bytes  # [steps]
    t = unlimited_step_time(
        reads,
        profile=profile,
        weight_bytes=geometry.weight_bytes,
        hbm_write_bytes=float(geometry.token_bytes),
    )
    return float(jnp.sum(t)) * geometry.num_layers


def pool_capacity(
    geometry: Geometry,
    hbm_budget: float,
    num_layers: int,
    block_size: int,
    capacity_blocks: int | None = None,
):
    """(geometry with `num_layers` layers, HBM pool blocks per layer): `capacity_blocks` when
    given, else what `hbm_budget` bytes leave for KV after the weights, less the tail block.
    Under a batch (`Geometry.batch`) the pool is per sequence: the budget holds `batch` pools of
    that many blocks (and tails) per layer, and `capacity_blocks` is taken as one sequence's.

    Raises ValueError when the budget leaves no room for one block, or capacity_blocks < 0.
    """
    if num_layers != geometry.num_layers:
        geometry = dataclasses.replace(geometry, num_layers=num_layers)
    if capacity_blocks is None:
        capacity_blocks = geometry.hbm_capacity_tokens(hbm_budget) // block_size - 1
        if capacity_blocks < 0:
            raise ValueError(
                f"HBM budget {hbm_budget / 1e9:.3f} GB leaves no room after the "
                f"{geometry.param_bytes / 1e9:.1f} GB of parameters for one block of "
                f"{block_size} tokens besides the tail block: expected a larger budget"
            )
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    return geometry, capacity_blocks


@dataclasses.dataclass(frozen=True)
class CostModel:
    """The environment a placement plan is priced in: one static object, passed to
    `Policy.plan` (hashable: a static jit argument).

    profile: the two tiers' bandwidths. block_bytes: one block of one layer (K and V).
    fixed_bytes: a layer's HBM bytes per step besides the KV reads (its weights and the token's
    write). demote_cost: the bytes of a demotion on each side, as a fraction of a block (0: the
    host keeps a copy, an inclusive cache; the decode loop's exclusive cache copies it: 1).
    keep_fetched: a block read from host at the previous step can be promoted for the HBM write
    alone (the simulator's option; the decode loop re-reads the host pool: False).
    prompt_len, block_size: tokens of the prompt and per block (the learned forecaster's
    features).
    host_block_bytes: one host-tier block's bytes, what crosses the link when it is read,
    promoted or demoted (smaller than block_bytes when the host tier holds FP8,
    `CacheConfig(fp8="host")`); None: block_bytes.
    """

    profile: HardwareProfile = PROFILES["gh200"]
    block_bytes: float = 16 * 4096.0
    fixed_bytes: float = 436e6
    demote_cost: float = 0.0
    keep_fetched: bool = False
    prompt_len: int = 0
    block_size: int = 16
    host_block_bytes: float | None = None

    def __post_init__(self):
        check_number("CostModel block_bytes", self.block_bytes, low=0.0, low_open=True)
        if self.host_block_bytes is not None:
            check_number(
                "CostModel host_block_bytes", self.host_block_bytes, low=0.0, low_open=True
            )
        check_number("CostModel fixed_bytes", self.fixed_bytes, low=0.0)
        check_number("CostModel demote_cost", self.demote_cost, low=0.0)
        check_number("CostModel prompt_len", self.prompt_len, integer=True, low=0)
        check_number("CostModel block_size", self.block_size, integer=True, low=1)

    @property
    def link_block_bytes(self) -> float:
        """Bytes one block moves over the link (`host_block_bytes`, else `block_bytes`)."""
        return self.block_bytes if self.host_block_bytes is None else self.host_block_bytes

    @property
    def priced_profile(self) -> HardwareProfile:
        """The profile plans are priced with, in units of `block_bytes`: the link bandwidth
        scaled by block_bytes / link_block_bytes. Every link term of the model is a count of
        blocks times their link bytes over B_link, so pricing a block at `block_bytes` over
        this bandwidth is exact (`link_profile`)."""
        return link_profile(self.profile, self.block_bytes, self.link_block_bytes)

    @property
    def link_seconds(self) -> float:
        """Seconds for one block to cross the link."""
        return self.link_block_bytes / self.profile.link_bandwidth


def link_profile(profile: HardwareProfile, block_bytes: float, link_block_bytes) -> HardwareProfile:
    """`profile` with its link bandwidth in units of `block_bytes`: B_link x block_bytes /
    link_block_bytes. A host-tier block that moves `link_block_bytes` over the link (FP8: about
    half a bf16 block) then costs its true time when counted at `block_bytes`; the bounds of this
    module stay valid with it (the Unlimited split just sees a faster link). `profile` itself
    when the two are equal or `link_block_bytes` is None."""
    if link_block_bytes is None or float(link_block_bytes) == float(block_bytes):
        return profile
    bw = profile.link_bandwidth * float(block_bytes) / float(link_block_bytes)
    return dataclasses.replace(profile, name=f"{profile.name}+fp8-link", link_bandwidth=bw)
