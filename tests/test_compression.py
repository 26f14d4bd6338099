"""The codecs on their own: round-trip error within the stated bounds, wire sizes,
and error feedback that loses no gradient (no cluster needed)."""

from __future__ import annotations

import numpy as np
import pytest

from dasktf.compression import (
    INT8_BLOCK,
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
    from dasktf.ps import shard_plan

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
