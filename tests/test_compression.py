"""The codecs on their own: round-trip error within the stated bounds, wire sizes,
and error feedback that loses no gradient (no cluster needed)."""

from __future__ import annotations

import numpy as np
import pytest

from dasktf.wire.codecs import (
    INT8_BLOCK,
    Encoded,
    ErrorFeedback,
    decode,
    get_codec,
    validate_weights_dtype,
)


@pytest.fixture
def grad():
    rng = np.random.default_rng(0)
    # gradient-like: mostly small, a few large components, several magnitudes
    return (rng.standard_normal(10_007) * rng.lognormal(-4, 2, 10_007)).astype(np.float32)


def test_none_is_exact(grad):
    e = get_codec("none").encode(grad)
    assert np.array_equal(decode(e), grad)
    assert e.nbytes == 4 * grad.size


def test_fp16_within_half_precision(grad):
    x = np.clip(grad, -6e4, 6e4)
    x = x[np.abs(x) > 6.2e-5]  # fp16's normal range: relative bound holds there
    e = get_codec("fp16").encode(x)
    assert e.nbytes == 2 * x.size
    assert np.all(np.abs(decode(e) - x) <= 2.0**-11 * np.abs(x))


def test_bf16_within_eight_bits(grad):
    e = get_codec("bf16").encode(grad)
    assert e.nbytes == 2 * grad.size
    assert np.all(np.abs(decode(e) - grad) <= 2.0**-8 * np.abs(grad))
    assert decode(get_codec("bf16").encode(np.array([1e30], np.float32)))[0] > 9e29


def test_int8_within_block_scale(grad):
    e = get_codec("int8").encode(grad)
    blocks = -(-grad.size // INT8_BLOCK)
    assert e.nbytes == grad.size + 4 * blocks
    err = np.abs(decode(e) - grad)
    for b in range(blocks):
        part = slice(b * INT8_BLOCK, (b + 1) * INT8_BLOCK)
        assert err[part].max() <= np.abs(grad[part]).max() / 254 * (1 + 1e-6)


def test_topk_keeps_the_largest(grad):
    codec = get_codec("topk:0.01")
    e = codec.encode(grad)
    k = int(np.ceil(0.01 * grad.size))
    assert e.nbytes == 8 * k
    out = decode(e)
    kept = np.flatnonzero(out)
    assert len(kept) == k
    assert np.array_equal(out[kept], grad[kept])
    assert np.abs(grad[out == 0]).max() <= np.abs(grad[kept]).min()
    # a sum of sparse buffers goes back exactly
    total = out + decode(codec.encode(grad[::-1].copy()))
    assert np.array_equal(decode(codec.encode_sum(total)), total)


def test_error_feedback_preserves_the_sum():
    rng = np.random.default_rng(1)
    for name in ["fp16", "bf16", "int8", "topk:0.01"]:
        feedback = ErrorFeedback(get_codec(name))
        sent = np.zeros(5000, np.float64)
        true = np.zeros(5000, np.float64)
        for _ in range(40):
            g = rng.standard_normal(5000).astype(np.float32)
            true += g
            sent += decode(feedback.encode(g))
        assert feedback.residual is not None
        np.testing.assert_allclose(sent + feedback.residual, true, atol=1e-3, err_msg=name)
    # without feedback, topk would have lost most of the gradient
    plain = get_codec("topk:0.01")
    lost = sum(decode(plain.encode(np.ones(5000, np.float32))) for _ in range(40))
    assert lost.sum() < 0.05 * 40 * 5000


@pytest.mark.parametrize("bad", ["zip", "topk", "topk:0", "topk:2", "fp16:3", 7])
def test_bad_codec_names_fail_clearly(bad):
    with pytest.raises((ValueError, TypeError), match="compression"):
        get_codec(bad)


def test_weights_dtype():
    assert validate_weights_dtype("float32") is None
    assert validate_weights_dtype("bf16") == "bf16"
    with pytest.raises(ValueError, match="weights_dtype"):
        validate_weights_dtype("int8")


def test_shard_plan_is_balanced_and_covers_every_value():
    from dasktf.wire.packets import shard_plan

    # a big embedding-like matrix, a dense layer, biases
    shapes = [(5000, 64), (64, 100), (100,), (100, 10), (10,)]
    total = sum(int(np.prod(s)) for s in shapes)
    for k in (1, 2, 3):
        plan = shard_plan(shapes, k)
        covered = np.zeros(total, int)
        for ranges in plan:
            for a, b in ranges:
                covered[a:b] += 1
        assert np.all(covered == 1)
        loads = [sum(b - a for a, b in r) for r in plan]
        # the big matrix is cut along its first axis (whole rows), so no server
        # carries much more than its fair share
        assert max(loads) <= 1.05 * total / k
    big = shard_plan(shapes, 3)
    assert all(((a % 64) == 0) for r in big for a, b in r if b <= 5000 * 64)
    with pytest.raises(ValueError, match="num_ps=3"):
        shard_plan([(1,)], 3)


# -- the fast kernels (dasktf.wire.halfcast, Int8, ErrorFeedback buffers) are exact ---------
def _awkward_floats(n=300_000):
    """Every float32 exponent (random bit patterns), gradient-like magnitudes, the
    float16 midpoints (ties), and the special values."""
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    grads = (rng.standard_normal(n) * 10.0 ** rng.uniform(-12, 6, n)).astype(np.float32)
    halves = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = halves[np.isfinite(halves)].astype(np.float64)
    finite.sort()
    ties = ((finite[:-1] + finite[1:]) / 2).astype(np.float32)
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 1e-8, 2**-24,
         2**-25, 3 * 2**-26, -(2**-25), 1 + 2**-11, 1 + 3 * 2**-11, 3.4e38],
        np.float32,
    )
    return np.concatenate([bits, grads, ties, special])


def test_fp16_codec_matches_numpys_cast_bit_for_bit():
    """Every float32 exponent, ties, subnormals, overflow and NaN encode as NumPy's
    cast does; every one of the 65,536 halves decodes exactly (into ``out`` too)."""
    codec = get_codec("fp16")
    x = _awkward_floats()
    with np.errstate(all="ignore"):
        want = x.astype(np.float16)
    got = codec.encode(x).arrays[0]
    assert got.dtype == np.float16
    nan = np.isnan(x)
    assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
    assert np.isnan(got[nan]).all()
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    with np.errstate(all="ignore"):
        want32 = every.astype(np.float32)
    wire = Encoded("fp16", every.size, (every,))
    out = np.full(every.size, 7.0, np.float32)
    for got32 in (decode(wire), decode(wire, out=out)):
        same = (got32.view(np.uint32) == want32.view(np.uint32)) | (
            np.isnan(got32) & np.isnan(want32)
        )
        assert same.all()
    assert decode(wire, out=out) is out


def test_bf16_kernels_match_ml_dtypes_bit_for_bit():
    import ml_dtypes

    from dasktf.wire.halfcast import bf16_bits_to_f32, f32_to_bf16_bits

    x = _awkward_floats()
    with np.errstate(all="ignore"):
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    got = f32_to_bf16_bits(x)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.isnan(bf16_bits_to_f32(got[nan])).all()
    assert np.array_equal(
        bf16_bits_to_f32(want[~nan]), want[~nan].view(ml_dtypes.bfloat16).astype(np.float32)
    )


@pytest.mark.parametrize("n", [1, 255, 256, 257, 128 * 256 + 3, 300_001])
def test_int8_matches_the_plain_formula(n):
    # the chunked kernel against the textbook one, on ragged and whole blocks
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * rng.lognormal(-4, 2, n)).astype(np.float32)
    x[: min(n, 300)] = 0  # an all-zero block has scale 0
    blocks = -(-n // INT8_BLOCK)
    padded = np.zeros(blocks * INT8_BLOCK, np.float32)
    padded[:n] = x
    padded = padded.reshape(blocks, INT8_BLOCK)
    scale = (np.abs(padded).max(axis=1) / np.float32(127.0)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    q = np.clip(np.rint(padded / safe[:, None]), -127, 127).astype(np.int8).ravel()[:n]
    e = get_codec("int8").encode(x)
    assert np.array_equal(e.arrays[0], q)
    assert np.array_equal(e.arrays[1], scale)
    want = q.astype(np.float32) * np.repeat(scale, INT8_BLOCK)[:n]
    assert np.array_equal(decode(e), want)


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "topk:0.01"])
def test_error_feedback_reuses_its_buffers_with_the_same_result(name):
    rng = np.random.default_rng(4)
    codec = get_codec(name)
    feedback = ErrorFeedback(codec)
    residual = np.zeros(3001, np.float32)
    for _ in range(5):
        g = (rng.standard_normal(3001) * 1e-5).astype(np.float32)
        target = g + residual
        sent = feedback.encode(g)
        expected = codec.encode(target)
        assert all(np.array_equal(a, b) for a, b in zip(sent.arrays, expected.arrays, strict=False))
        residual = target - decode(expected)
        assert np.array_equal(feedback.residual, residual)
    out = np.full(3001, 7.0, np.float32)
    assert decode(sent, out=out) is out
    assert np.array_equal(out, decode(sent))
