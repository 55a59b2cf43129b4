"""gather_rows / scatter_rows (Pallas, Triton lowering; the interpreter on CPU) against their
pure-jnp references, on device and pinned_host pools."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import single_device_sharding
from pallas_kernels.host_transfer import (
    MAX_CHUNK,
    gather_rows,
    gather_rows_reference,
    row_chunk,
    scatter_rows,
    scatter_rows_reference,
)


def bits(x):
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def pool_and_rows(seed, n_rows, elems, n, dtype):
    rng = np.random.default_rng(seed)
    pool = jnp.asarray(rng.standard_normal((n_rows, elems)), dtype)
    rows = rng.permutation(n_rows)[:n].astype(np.int32)
    rows[rng.random(n) < 0.3] = -1  # unused entries
    return pool, jnp.asarray(rows)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("elems", [1, 48, 3 * 5 * 7, 2 * MAX_CHUNK + 512])
def test_gather_matches_reference(dtype, elems):
    pool, rows = pool_and_rows(0, 11, elems, 7, dtype)
    got = gather_rows(pool, rows, interpret=True)
    want = gather_rows_reference(pool, rows)
    np.testing.assert_array_equal(bits(got), bits(want))
    assert not np.asarray(got)[np.asarray(rows) < 0].any()  # unused entries are zeros


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("elems", [1, 3 * 5 * 7, 2 * MAX_CHUNK + 512])
def test_scatter_matches_reference(dtype, elems):
    pool, rows = pool_and_rows(1, 9, elems, 6, dtype)
    vals = jnp.asarray(np.random.default_rng(2).standard_normal((6, elems)), dtype)
    want = scatter_rows_reference(pool, rows, vals)
    got = scatter_rows(jnp.array(pool), rows, vals, interpret=True)
    np.testing.assert_array_equal(bits(got), bits(want))
    untouched = np.setdiff1d(np.arange(9), np.asarray(rows))
    np.testing.assert_array_equal(bits(got)[untouched], bits(pool)[untouched])


def test_pinned_host_pool_inside_jit():
    """The cache's case: the pool in pinned_host memory, the kernels inside a jit (the write
    donated, its result placed back in host memory)."""
    hs = single_device_sharding(jax.devices()[0], memory_kind="pinned_host")
    pool, rows = pool_and_rows(3, 10, 64, 5, jnp.float32)
    host = jax.device_put(pool, hs)
    got = jax.jit(lambda p, r: gather_rows(p, r, interpret=True))(host, rows)
    np.testing.assert_array_equal(got, gather_rows_reference(pool, rows))
    vals = jnp.ones((5, 64), jnp.float32)
    write = jax.jit(
        lambda p, r, v: jax.device_put(scatter_rows(p, r, v, interpret=True), hs),
        donate_argnums=(0,),
    )
    out = write(host, rows, vals)
    assert out.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(out, scatter_rows_reference(pool, rows, vals))


def test_row_chunk_divides_the_row():
    for e in (1, 2, 96, 105, 4096, 16384, 3 * 4096):
        c = row_chunk(e)
        assert e % c == 0 and c <= MAX_CHUNK and c & (c - 1) == 0


def test_error_pool_not_2d():
    with pytest.raises(ValueError, match=r"pool must be \[rows, elements\]"):
        gather_rows(jnp.zeros((2, 3, 4)), jnp.zeros((1,), jnp.int32))


def test_error_rows_dtype():
    with pytest.raises(ValueError, match=r"rows must be a 1-D int32 array"):
        gather_rows(jnp.zeros((2, 4)), jnp.zeros((1,), jnp.float32))


def test_error_values_shape():
    with pytest.raises(ValueError, match=r"values is float32 \(2, 4\), expected float32 \(1, 4\)"):
        scatter_rows(jnp.zeros((2, 4)), jnp.zeros((1,), jnp.int32), jnp.zeros((2, 4)))


def test_error_empty_row():
    with pytest.raises(ValueError, match=r"rows must have at least one element"):
        row_chunk(0)
