"""Trace format: round trip, one test per validation message, synthetic generators."""

import numpy as np
import pytest

from jaxkv import cost
from jaxkv.sim import trace as tr
from jaxkv.sim import trace_fields


def fields(**over):
    ids = np.array([[[0, 1, -1]], [[2, 0, 1]]], np.int32)  # [steps=2, layers=1, K=3]
    mass = np.array([[[0.5, 0.5, 0.0]], [[0.2, 0.3, 0.5]]], np.float32)
    f = dict(
        version=np.int64(1), prompt_len=np.int64(2), block_size=np.int64(1), ids=ids, mass=mass
    )
    f.update(over)
    return f


def test_round_trip(tmp_path):
    t = tr.validate(fields())
    tr.save(tmp_path / "t.npz", t)
    u = tr.load(tmp_path / "t.npz")
    np.testing.assert_array_equal(u.ids, t.ids)
    np.testing.assert_array_equal(u.mass_values, t.mass_values)
    assert (u.prompt_len, u.block_size, u.steps, u.num_layers, u.num_blocks) == (2, 1, 2, 1, 4)
    dense = np.asarray(u.mass(0, 3))  # one step past the end is zero
    np.testing.assert_allclose(dense[0, 0], [0.5, 0.5, 0.0, 0.0])
    np.testing.assert_allclose(dense[1, 0], [0.3, 0.5, 0.2, 0.0])
    assert dense[2].sum() == 0


def test_missing_field():
    f = fields()
    del f["mass"]
    with pytest.raises(ValueError, match=r"missing field 'mass'"):
        tr.validate(f)


def test_wrong_mass_shape():
    with pytest.raises(ValueError, match=r"field 'mass' has shape \(2, 1\), expected the shape"):
        tr.validate(fields(mass=np.zeros((2, 1), np.float32)))


def test_wrong_ids_rank():
    with pytest.raises(ValueError, match=r"field 'ids' has shape \(3,\), expected \[steps"):
        tr.validate(fields(ids=np.zeros(3, np.int32), mass=np.zeros(3, np.float32)))


def test_float_ids():
    with pytest.raises(ValueError, match=r"field 'ids' has dtype float32"):
        tr.validate(fields(ids=np.zeros((2, 1, 3), np.float32)))


def test_negative_id():
    ids = np.array([[[0, -3, -1]], [[2, 0, 1]]], np.int32)
    with pytest.raises(ValueError, match=r"field 'ids' has id -3, expected >= 0"):
        tr.validate(fields(ids=ids))


def test_id_beyond_context():
    ids = np.array([[[0, 3, -1]], [[2, 0, 1]]], np.int32)  # step 0 has 3 blocks
    with pytest.raises(ValueError, match=r"'ids' has id 3 at step 0, layer 0, beyond the context"):
        tr.validate(fields(ids=ids))


def test_nan_mass():
    mass = np.full((2, 1, 3), np.nan, np.float32)
    with pytest.raises(ValueError, match=r"field 'mass' has NaN or infinite values"):
        tr.validate(fields(mass=mass))


def test_negative_mass():
    mass = np.full((2, 1, 3), -1.0, np.float32)
    with pytest.raises(ValueError, match=r"field 'mass' has value -1.0, expected >= 0"):
        tr.validate(fields(mass=mass))


def test_bad_version():
    with pytest.raises(ValueError, match=r"field 'version' is 3, expected 1 or 2"):
        tr.validate(fields(version=np.int64(3)))


def test_bad_block_size():
    with pytest.raises(ValueError, match=r"field 'block_size' is 0, expected >= 1"):
        tr.validate(fields(block_size=np.int64(0)))


def test_bad_prompt_len():
    with pytest.raises(ValueError, match=r"field 'prompt_len' is -1, expected >= 0"):
        tr.validate(fields(prompt_len=np.int64(-1)))


def test_unknown_synthetic_kind_lists_kinds():
    with pytest.raises(ValueError, match=r"unknown synthetic trace 'zipf'.*recency-low"):
        tr.parse_spec("synthetic:zipf", prompt_len=10, steps=2, num_layers=1, block_size=1)


@pytest.mark.parametrize("kind", tr.SYNTHETIC_KINDS)
def test_synthetic_is_deterministic_and_causal(kind):
    t = tr.SyntheticTrace(kind, prompt_len=100, steps=20, num_layers=2, block_size=4, seed=3)
    a, b = np.asarray(t.mass(5, 10)), np.asarray(t.mass(5, 10))
    np.testing.assert_array_equal(a, b)
    assert np.all(np.isfinite(a)) and np.all(a >= 0)
    for i in range(10):  # zero beyond each step's context
        assert a[i, :, tr.context_blocks(100, 5 + i, 4) :].sum() == 0
    # a window computed alone equals the same steps of a longer one
    np.testing.assert_allclose(np.asarray(t.mass(0, 15))[5:], a[:10])
    other = np.asarray(tr.SyntheticTrace(kind, 100, 20, 2, 4, seed=4).mass(5, 10))
    assert not np.array_equal(a, other)


def test_synthetic_dynamics_match_their_descriptions():
    low, high = (
        tr.read_stats(tr.SyntheticTrace(k, 4000, 120, 2, 16), 0.6)
        for k in ("recency-low", "recency-high")
    )
    assert 0.05 < low["swap_per_step"] < 0.2  # "about 10% of the set swapped per step"
    assert high["swap_per_step"] > 3 * low["swap_per_step"]


def test_synthetic_real_like_flickers_like_a_recorded_trace():
    # real-like is calibrated to a recorded token-level trace (RESULTS, "Trace dynamics"): about
    # 30% swapped per step at s = 0.6, and leavers often back two steps later; recency-low's
    # leavers stay away (its noise is redrawn every 6 steps).
    real, low = (
        tr.read_stats(tr.SyntheticTrace(k, 4000, 120, 2, 16), 0.6)
        for k in ("real-like", "recency-low")
    )
    assert 0.2 < real["swap_per_step"] < 0.4, real
    assert real["leavers_back_1"] > 0.3 and real["leavers_back_5"] > 0.6, real
    assert low["leavers_back_1"] < 0.1, low


def test_read_stats_leavers_by_hand():
    # four prompt blocks; every block with mass is read (s = 0). Rows: steps 0..7.
    reads = np.array(
        [
            [1, 1, 1, 0],
            [1, 0, 1, 0],
            [0, 0, 1, 1],
            [1, 0, 1, 0],
            [0, 0, 1, 0],
            [0, 0, 1, 0],
            [0, 1, 1, 0],
            [0, 0, 1, 0],
        ]
    )
    ids = np.where(reads > 0, np.arange(4), -1).astype(np.int32)[:, None, :]
    t = tr.validate(
        fields(prompt_len=np.int64(4), ids=ids, mass=reads[:, None, :].astype(np.float32))
    )
    st = tr.read_stats(t, 0.0)
    # within 1 (counted for leavers at t < 6): block 0 at t=1 is back at 3; block 0 at t=3,
    # block 1 at t=0 and block 3 at t=2 are not -> 1/4. Within 5 (t < 2): block 0 at t=1 (back
    # at 3) and block 1 at t=0 (back at 6) -> 2/2.
    assert st["leavers_back_1"] == pytest.approx(0.25)
    assert st["leavers_back_5"] == pytest.approx(1.0)


def test_to_file_trace_round_trips_synthetic(tmp_path):
    s = tr.SyntheticTrace("patterns", prompt_len=40, steps=6, num_layers=2, block_size=8)
    f = tr.to_file_trace(s)
    tr.save(tmp_path / "p.npz", f)
    np.testing.assert_allclose(tr.load(tmp_path / "p.npz").mass(0, 6), s.mass(0, 6), rtol=1e-6)


def test_synthetic_token_reads_cluster_in_passages():
    # At token granularity reads come in passages (SPAN_TOKENS): a read token's neighbour is read
    # far more often than the read fraction alone would give (0.4 at s = 0.6).
    t = tr.SyntheticTrace("recency-low", prompt_len=4096, steps=2, num_layers=2, block_size=1)
    r = np.asarray(tr.read_mask(t.mass(0, 1), t.prompt_len, 1, 0.6, 0))[0]  # [layers, N]
    both = (r[:, :-1] & r[:, 1:]).sum() / r[:, :-1].sum()
    assert both > 0.6, both


def test_scalar_field_given_as_array():
    with pytest.raises(ValueError, match=r"field 'prompt_len' has shape \(2,\), expected a scalar"):
        tr.validate(fields(prompt_len=np.array([2, 3])))


def test_scalar_field_not_an_integer():
    with pytest.raises(ValueError, match=r"'prompt_len' is 40.7 of dtype float64, expected an int"):
        tr.validate(fields(prompt_len=np.float64(40.7)))
    with pytest.raises(ValueError, match=r"'version' is 'one' of dtype <U3, expected an integer"):
        tr.validate(fields(version=np.str_("one")))


@pytest.mark.parametrize("dtype", [np.complex64, np.str_, np.object_])
def test_mass_not_real(dtype):
    mass = fields()["mass"].astype(dtype)
    with pytest.raises(ValueError, match=r"field 'mass' has dtype .*, expected a real floating"):
        tr.validate(fields(mass=mass))


def test_name_not_a_string():
    with pytest.raises(ValueError, match=r"field 'name' has dtype int64 and shape \(\), expected"):
        tr.validate(fields(name=np.int64(3)))


def test_positions_past_int32():
    with pytest.raises(ValueError, match=r"'prompt_len' is 2147483647: with 2 steps the positions"):
        tr.validate(fields(prompt_len=np.int64(2**31 - 1)))
    with pytest.raises(ValueError, match=r"prompt_len \+ steps = 2147483647 \+ 2 passes"):
        tr.SyntheticTrace("recency-low", prompt_len=2**31 - 1, steps=2)


def test_synthetic_sizes_and_seed():
    with pytest.raises(ValueError, match=r"synthetic trace prompt_len must be an integer >= 0"):
        tr.SyntheticTrace("recency-low", prompt_len=40.5)
    with pytest.raises(ValueError, match=r"trace seed must lie in \[0, 2\*\*32\), got -1"):
        tr.SyntheticTrace("recency-low", seed=-1)


def test_load_corrupt_member(tmp_path):
    """A damaged field inside an intact archive is named (it was zipfile's BadZipFile)."""
    path = tmp_path / "t.npz"
    np.savez(path, **fields(mass=np.full((2, 1, 3), 0.123, np.float32)))
    data = bytearray(path.read_bytes())
    at = bytes(data).index(np.float32(0.123).tobytes())
    data[at : at + 4] = np.float32(0.5).tobytes()  # the CRC no longer matches
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"field 'mass' is unreadable, the file is truncated or"):
        tr.load(path)


def test_load_not_an_archive(tmp_path):
    (tmp_path / "t.npz").write_text("hello")
    with pytest.raises(ValueError, match=r"t.npz': not an .npz archive \(the file starts with b"):
        tr.load(tmp_path / "t.npz")


# --------------------------------------------------------------------------- version 2

GEOMETRY = cost.Geometry("rec", 1, 3, 64, 2, 9.0e6, 2.7e8)  # [1 layer] like fields()' trace


def v2(**over):
    """fields() of a version-2 trace: with its geometry and the tokens of its 2 steps."""
    f = fields(version=np.int64(2), tokens=np.array([7, 2], np.int32))
    f |= trace_fields.geometry_fields(GEOMETRY)
    f.update(over)
    return f


def test_version_2_round_trips_geometry_and_tokens(tmp_path):
    t = tr.validate(v2())
    assert t.geometry == GEOMETRY and t.tokens.dtype == np.int32
    tr.save(tmp_path / "t.npz", t)
    with np.load(tmp_path / "t.npz") as z:
        assert int(z["version"]) == 2 and str(z["geometry_name"]) == "rec"
    u = tr.load(tmp_path / "t.npz")
    assert u.geometry == GEOMETRY
    np.testing.assert_array_equal(u.tokens, [7, 2])
    # without them a trace is written as version 1, which older readers load
    tr.save(tmp_path / "v1.npz", tr.validate(fields()))
    with np.load(tmp_path / "v1.npz") as z:
        assert int(z["version"]) == 1 and "tokens" not in z.files
    assert tr.load(tmp_path / "v1.npz").geometry is None
    synthetic = tr.SyntheticTrace("patterns", 40, 4, 2, 8)
    assert synthetic.geometry is None and synthetic.tokens is None
    assert tr.to_file_trace(t).geometry == GEOMETRY  # materializing keeps them
    np.testing.assert_array_equal(tr.to_file_trace(t).tokens, [7, 2])


def test_compact_storage(tmp_path):
    """compact: int16 ids and float16 mass on disk (a tiny mass stays positive), int32 and
    float32 in memory; ids that do not fit int16 stay int32."""
    mass = np.array([[[0.5, 1e-9, 0.0]], [[0.2, 0.3, 0.5]]], np.float32)
    t = tr.validate(fields(mass=mass))
    tr.save(tmp_path / "c.npz", t, compact=True)
    with np.load(tmp_path / "c.npz") as z:
        assert z["ids"].dtype == np.int16 and z["mass"].dtype == np.float16
    u = tr.load(tmp_path / "c.npz")
    assert u.ids.dtype == np.int32 and u.mass_values.dtype == np.float32
    np.testing.assert_array_equal(u.ids, t.ids)
    np.testing.assert_allclose(u.mass_values, mass, rtol=2**-11, atol=1e-7)
    assert u.mass_values[0, 0, 1] > 0  # below float16's range, still read
    big = np.array([[[40_000]], [[40_001]]], np.int32)  # block ids past int16
    t = tr.validate(
        fields(
            prompt_len=np.int64(16 * 40_001),
            block_size=np.int64(16),
            ids=big,
            mass=np.ones((2, 1, 1), np.float32),
        )
    )
    tr.save(tmp_path / "b.npz", t, compact=True)
    with np.load(tmp_path / "b.npz") as z:
        assert z["ids"].dtype == np.int32
    np.testing.assert_array_equal(tr.load(tmp_path / "b.npz").ids, big)


def test_compact_mass_beyond_float16(tmp_path):
    mass = np.full((2, 1, 3), 1e5, np.float32)
    mass[0, 0, 2] = 0.0  # the padding entry
    t = tr.validate(fields(mass=mass))
    with pytest.raises(ValueError, match=r"stores mass as float16, whose largest value is 65504"):
        tr.save(tmp_path / "c.npz", t, compact=True)


def test_version_2_field_in_a_version_1_trace():
    with pytest.raises(ValueError, match=r"'tokens' is a version-2 field, but 'version' is 1"):
        tr.validate(fields(tokens=np.array([7, 2], np.int32)))


def test_geometry_missing_a_field():
    f = v2()
    del f["geometry_head_dim"]
    with pytest.raises(
        ValueError, match=r"missing field 'geometry_head_dim': a geometry needs all"
    ):
        tr.validate(f)


def test_geometry_of_other_depth():
    with pytest.raises(
        ValueError, match=r"'geometry_num_layers' is 30, expected the trace's 1 layers"
    ):
        tr.validate(v2(geometry_num_layers=np.int64(30)))


def test_geometry_size_below_one():
    with pytest.raises(ValueError, match=r"'geometry_kv_heads' is 0, expected an integer >= 1"):
        tr.validate(v2(geometry_kv_heads=np.int64(0)))


def test_geometry_negative_bytes():
    with pytest.raises(
        ValueError, match=r"'geometry_weight_bytes' is -1.0, expected a finite number >= 0"
    ):
        tr.validate(v2(geometry_weight_bytes=np.float64(-1.0)))


def test_geometry_bytes_not_a_number():
    with pytest.raises(
        ValueError, match=r"'geometry_param_bytes' has dtype <U2 and shape \(\), expected a real"
    ):
        tr.validate(v2(geometry_param_bytes=np.str_("1e")))


def test_geometry_name_not_a_string():
    with pytest.raises(ValueError, match=r"'geometry_name' has dtype int64 and shape \(\), expec"):
        tr.validate(v2(geometry_name=np.int64(1)))


def test_tokens_of_other_length():
    with pytest.raises(ValueError, match=r"'tokens' has shape \(3,\), expected \[steps\] = \(2,\)"):
        tr.validate(v2(tokens=np.array([1, 2, 3])))


def test_tokens_not_integers():
    with pytest.raises(ValueError, match=r"'tokens' has dtype float32, expected an integer"):
        tr.validate(v2(tokens=np.array([1.0, 2.0], np.float32)))


def test_tokens_out_of_range():
    with pytest.raises(ValueError, match=r"'tokens' has token -1, expected in \[0, 2147483647\]"):
        tr.validate(v2(tokens=np.array([1, -1])))


@pytest.mark.parametrize(
    "over, message",
    [
        (
            dict(mass=np.array([[[0.5, 0.5, 0.1]], [[0.2, 0.3, 0.5]]], np.float32)),
            r"'mass' has 0.1 on padding \(id -1\) at step 0, layer 0: expected 0 on padding",
        ),
        (
            dict(ids=np.array([[[0, 1, -1]], [[2, 0, 2]]], np.int32)),
            r"'ids' lists block 2 twice at step 1, layer 0: expected each block at most once",
        ),
    ],
)
def test_entries_a_trace_cannot_mean(over, message):
    """Mass on padding and a block listed twice were accepted."""
    with pytest.raises(ValueError, match=message):
        tr.validate(fields(**over))


def test_a_trace_file_without_mass_is_refused(tmp_path):
    """An all-zero trace file gave a 0% hit rate for every policy."""
    path = tmp_path / "zero.npz"
    np.savez(path, **fields(mass=np.zeros((2, 1, 3), np.float32)))
    with pytest.raises(
        ValueError, match=r"zero.npz': field 'mass' is all zero: expected the ids' attention mass"
    ):
        tr.load(path)
