"""The top-k and ternary ops: native kernels bit for bit against the pure-torch reference, error feedback,
non-finite markers, and a decoder that refuses every malformed message without writing anything."""
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import gradshare
from gradshare import MessageError, message as M, ops, reference as R
from op_inputs import assert_bits_equal

SIZES = [0, 1, 15, 16, 17, 255, 4095, 4096, 4097, 2 * 4096 + 1, 70001]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _state(n, dtype=torch.float32, seed=0, ties=True):
    g = torch.Generator().manual_seed(seed)
    update = (torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4).to(dtype)
    residual = torch.randn(n, generator=g) * 0.01
    if ties and n > 8:      # equal magnitudes, opposite signs, exact zeros and -0.0
        update[3] = update[2]
        residual[3] = residual[2]
        update[5], residual[5] = -update[2], -residual[2]
        update[6], residual[6] = 0.0, 0.0
        update[7], residual[7] = -0.0, -0.0
    return update, residual


def _both(fn_native, fn_ref, update, residual, *args):
    r1, r2 = residual.clone(), residual.clone()
    m1, m2 = fn_native(update, r1, *args), fn_ref(update, r2, *args)
    assert_bits_equal(m1, m2)
    assert_bits_equal(r1, r2)
    return m1, r1


def _topk(u, r, k, chunk, values="bf16"):
    return ops.encode_topk(u, r, k, chunk=chunk, values=values)


def _ternary(u, r, f, chunk):
    return ops.encode_ternary(u, r, f, chunk=chunk)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk,k", [(16, 1), (16, 16), (64, 3), (4096, 0), (4096, 41), (4096, 4096), (65536, 655)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("values", ["bf16", "int8", "sign"])
def test_topk_matches_reference(n, chunk, k, dtype, values):
    update, residual = _state(n, dtype)
    msg, kept = _both(_topk, R.encode_topk, update, residual, k, chunk, values)
    fmt = ops.TOPK_VALUES[values]
    assert msg.numel() == M.chunked_words(fmt, n, chunk, k)
    if n:
        assert msg[1] == fmt and msg[3] == chunk and msg[4] == k
    # Error feedback is exact: what was sent plus what is kept is u (as values: 0.0 + -0.0 is +0.0); for
    # "sign", u - s rounds once, so within a rounding of the larger of the two.
    out = torch.zeros(n)
    ops.decode(out, msg)
    u = residual + update.float()
    if values == "sign":
        assert_bits_equal(kept[out == 0], u[out == 0])
        torch.testing.assert_close(out + kept, u, rtol=0, atol=1e-6 * max(1.0, float(u.abs().max()) if n else 1.0))
    else:
        assert torch.equal(out + kept, u)


def _hard_chunks(kind, n, seed=0):
    """Inputs that test the CPU's sampled top-k selection and each way it falls back to the radix one."""
    g = torch.Generator().manual_seed(seed)
    update, residual = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.01
    if kind == "ties":          # a few distinct magnitudes: the k-th largest is shared by thousands
        update = torch.randint(-3, 4, (n,), generator=g).float()
        residual = torch.zeros(n)
    elif kind == "zeros":       # nearly all zero: the sampled magnitude is 0
        update = torch.where(torch.rand(n, generator=g) < 0.003, update, torch.zeros(n))
        residual = torch.zeros(n)
    elif kind == "rows":        # one large entry per 64 (a matrix's first column): a period of the layout
        update[::64] *= 1000
    elif kind == "spikes":      # a few huge entries, then many just below the sample's pick
        update[torch.randperm(n, generator=g)[:50]] = 1e6
    elif kind == "sampled":     # large exactly where csrc/cpu/chunked.cpp's select_topk samples a full chunk:
        for lo in range(0, n - 65535, 65536):   # it then finds fewer than k candidates and selects by radix
            i = torch.arange(1024)
            update[lo + i * 64 + (i * 7919) % 64] = 100.0 + torch.rand(1024, generator=g)
    elif kind == "wide":        # magnitudes over many octaves, denormals included
        update = update * torch.exp2(torch.randint(-140, 60, (n,), generator=g).float())
    return update, residual


@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "rows", "spikes", "sampled", "wide"])
@pytest.mark.parametrize("k", [1, 66, 655, 1311, 4096, 6553])
@pytest.mark.parametrize("values", ["int8", "sign"])
def test_topk_selection_of_large_chunks_matches_reference(kind, k, values):
    # 65536-element chunks (TopK's) take the sampled selection up to a density of 1/16 (k = 4096), the radix
    # one above it; the last chunk here is 14465 elements
    n = 2 * 65536 + 14465
    update, residual = _hard_chunks(kind, n)
    msg, kept = _both(_topk, R.encode_topk, update, residual, k, 65536, values)
    out = torch.zeros(n)
    ops.decode(out, msg)
    u = residual + update
    assert_bits_equal(kept[out == 0], u[out == 0])
    if values == "sign" and kind != "zeros":  # every entry sent decodes to +-s, s > 0: each chunk sent k_c
        for lo in range(0, n, 65536):
            kc = (k * min(65536, n - lo) + 65535) // 65536
            assert int((out[lo:lo + 65536] != 0).sum()) == kc


def _signs_round_trip(update, residual, k, chunk):
    """Top-k signs of update + residual, native and reference bit for bit, decoded by both alike; what was not
    sent stays whole in the kept residual. Returns (message, decoded, u)."""
    n = update.numel()
    msg, kept = _both(_topk, R.encode_topk, update, residual, k, chunk, "sign")
    assert msg.numel() == M.topks_words(n, chunk, k)
    out, want = torch.zeros(n), torch.zeros(n)
    ops.decode(out, msg)
    R.decode(want, msg)
    assert_bits_equal(out, want)
    u = residual + update
    assert_bits_equal(kept[out == 0], u[out == 0])
    return msg, out, u


@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "rows", "spikes", "wide"])
@pytest.mark.parametrize("chunk", [70_001, 2**31 - 1])
@pytest.mark.parametrize("density", [0.0, 1e-4, 0.02, 0.1, 1.0])
def test_topk_signs_over_chunks_longer_than_16_bits_match_reference(kind, chunk, density):
    # The signs layout codes indices in as many bits as a chunk needs, so a chunk may be the whole buffer
    # (TopK(chunk=None)): the top entries compete over all of it. 200003 elements: two chunks of 70001 and a
    # shorter last one, or one chunk (2^31 - 1 > n: the last, shorter chunk is all there is).
    n = 200_003
    update, residual = _hard_chunks(kind, n)
    k = min(chunk, round(density * chunk))
    msg, out, u = _signs_round_trip(update, residual, k, chunk)
    assert msg[3] == chunk
    for lo in range(0, n, chunk):                            # each chunk sent its k_c largest magnitudes
        hi = min(n, lo + chunk)
        kc = (k * (hi - lo) + chunk - 1) // chunk
        sent = out[lo:hi] != 0
        if kind != "zeros":
            assert int(sent.sum()) == kc
        if sent.any() and (~sent).any():
            assert u[lo:hi].abs()[~sent].max() <= u[lo:hi].abs()[sent].min()


def test_a_whole_bucket_chunk_is_refused_where_indices_are_16_bits():
    u, r = torch.zeros(70_000), torch.zeros(70_000)
    ops.encode_topk(u, r, 5, chunk=70_000, values="sign")
    for values in ("bf16", "int8"):
        with pytest.raises(ValueError, match="chunk"):
            ops.encode_topk(u, r, 5, chunk=70_000, values=values)
    msg = ops.encode_topk(torch.randn(70_000), r, 5, chunk=70_000, values="sign")
    for fmt in (M.TOPK, M.TOPK8):                             # the same header in a 16-bit layout: refused
        m = msg.clone()
        m[1] = fmt
        with pytest.raises(MessageError):
            ops.decode(torch.zeros(70_000), m)
        with pytest.raises(ValueError):
            R.decode(torch.zeros(70_000), m)


def test_topk_whole_bucket_compression_sends_its_density_of_the_bucket():
    c = gradshare.TopK(0.02, warmup_steps=0, values="sign", chunk=None)
    n = 150_001
    update, residual = _state(n)
    u = residual + update
    msg = c.encode(update, residual, 0)
    assert msg.numel() == c.words(n, 0) and msg[3] == n and msg[4] == c.k(0, n) == 3001
    out = torch.zeros(n)
    ops.decode(out, msg)
    sent = out != 0
    assert int(sent.sum()) == 3001 and u.abs()[~sent].max() <= u.abs()[sent].min()
    with pytest.raises(TypeError, match="pass n"):
        c.k(0)
    with pytest.raises(ValueError, match="values='sign'"):
        gradshare.TopK(0.02, chunk=None)
    with pytest.raises(ValueError, match="at most 65536"):
        gradshare.TopK(0.02, chunk=70_000)
    assert gradshare.TopK(0.02, chunk=70_000, values="sign").chunk == 70_000


def _scaled_chunks_match_reference(update, residual, scales, chunk, k, values, threads):
    """Top-k of update and residual scaled chunk by chunk (scales[i] for chunk i), on `threads` threads: the
    native message and kept residual are the reference's, bit for bit."""
    scale = torch.tensor(scales).repeat_interleave(chunk)[:update.numel()]
    gradshare.set_num_threads(threads)
    try:
        _both(_topk, R.encode_topk, update * scale, residual * scale, k, chunk, values)
    finally:
        gradshare.set_num_threads(2)


# Chunk by chunk scales for the floor a thread carries from one chunk's selection to the next one's
# (csrc/cpu/chunked.cpp, select_topk): alike chunks (the floor holds), chunks 2x and 1000x smaller (some but fewer
# than k candidates, or none: sampled instead), 1000x larger (past the cap), all zeros (no floor), and back.
FLOOR_SCALES = [1.0, 1.0, 1.0, 0.5, 1e-3, 1e-3, 1e3, 1e3, 0.0, 1.0, 2.0, 0.7, 1.0]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 66, 1311, 4096])
@pytest.mark.parametrize("values", ["int8", "sign"])
def test_topk_selection_from_the_last_chunks_floor_matches_reference(threads, k, values):
    n = len(FLOOR_SCALES) * 65536 - 4000
    _scaled_chunks_match_reference(*_hard_chunks("normal", n), FLOOR_SCALES, 65536, k, values, threads)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1e-3, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 1e3]), min_size=2, max_size=9),
       st.integers(1, 512), st.sampled_from(["bf16", "int8", "sign"]), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_property_topk_selection_from_any_floor_matches_reference(scales, k, values, threads, seed):
    # chunks of 8192, the shortest that select from candidates, at densities up to 1/16, scaled chunk by chunk
    n = len(scales) * 8192 - seed % 5000
    _scaled_chunks_match_reference(*_state(n, seed=seed, ties=False), scales, 8192, k, values, threads)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", [16, 64, 4096])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0, 7.5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ternary_matches_reference(n, chunk, fraction, dtype):
    update, residual = _state(n, dtype)
    msg, kept = _both(_ternary, R.encode_ternary, update, residual, fraction, chunk)
    assert msg.numel() == M.ternary_words(n, chunk)
    out = torch.zeros(n)
    ops.decode(out, msg)
    u = residual + update.float()
    sent = out != 0
    assert_bits_equal(kept[~sent], u[~sent])                 # what was not sent stays whole
    assert_bits_equal(kept[sent], u[sent] - out[sent])        # and what was, is taken off exactly
    assert int(msg[4]) == int(sent.sum())


def test_int8_values_are_multiples_of_a_chunk_scale():
    u = torch.tensor([0.5, -3.0, 2.0, 0.125, 3.0, -0.25, 1.0, -1.0])
    r = torch.zeros(8)
    msg = ops.encode_topk(u, r, 2, chunk=4, values="int8")   # scales 3/127 and 3/127
    assert msg.numel() == M.topk8_words(8, 4, 2) == 5 + 2 * 3
    out = torch.zeros(8)
    ops.decode(out, msg)
    s = torch.tensor(3.0) / 127
    assert out.tolist() == [0.0, (-127 * s).item(), (round(2.0 / s.item()) * s).item(), 0.0,
                            (127 * s).item(), 0.0, (round(1.0 / s.item()) * s).item(), 0.0]
    assert torch.equal(out + r, u)   # what rounding left out stays in the residual


def test_topk_picks_the_largest_per_chunk_with_values():
    u = torch.tensor([0.5, -3.0, 2.0, 0.125, 3.0, -0.25, 1.0, -1.0])   # all exact in bfloat16
    r = torch.zeros(8)
    msg = ops.encode_topk(u, r, 2, chunk=4)   # chunks [0.5, -3, 2, 0.125] and [3, -0.25, 1, -1]
    out = torch.zeros(8)
    ops.decode(out, msg)
    assert out.tolist() == [0.0, -3.0, 2.0, 0.0, 3.0, 0.0, 1.0, 0.0]   # 1.0 ties -1.0: the lower index wins
    assert r.tolist() == [0.5, 0.0, 0.0, 0.125, 0.0, -0.25, 0.0, -1.0]


def test_topk_signs_send_plus_minus_the_mean_of_the_chunks_entries():
    u = torch.tensor([0.5, -3.0, 2.0, 0.125, 3.0, -0.25, 1.0, -1.0])
    r = torch.zeros(8)
    msg = ops.encode_topk(u, r, 2, chunk=4, values="sign")   # entries -3, 2 (scale 2.5) and 3, 1 (scale 2)
    assert int(msg[1]) == M.TOPKSIGN and msg.numel() == M.topks_words(8, 4, 2) == 5 + 2 * 2
    out = torch.zeros(8)
    ops.decode(out, msg)
    assert out.tolist() == [0.0, -2.5, 2.5, 0.0, 2.0, 0.0, 2.0, 0.0]
    assert r.tolist() == [0.5, -0.5, -0.5, 0.125, 1.0, -0.25, -1.0, -1.0]


def test_topk_signs_code_an_index_in_about_3_plus_log2_of_the_gap_bits():
    n, chunk, k = 65536, 65536, 6554                         # 10%: 3 low, ~2.25 high and 1 sign bit an entry
    msg = ops.encode_topk(torch.randn(n), torch.zeros(n), k, chunk=chunk, values="sign")
    bits = (msg.numel() - M.HEADER_WORDS - 1) * 32 / k
    assert 6.2 < bits < 6.3
    assert M.topk8_words(n, chunk, k) / msg.numel() > 3.8   # against 24 bits an entry


def test_ternary_sends_plus_minus_the_mean_of_what_it_sends():
    u = torch.tensor([4.0, -2.0, 0.5, 0.0] + [0.0] * 12)   # one chunk of 16; mean |u| = 6.5 / 16
    r = torch.zeros(16)
    msg = ops.encode_ternary(u, r, 1.0, chunk=16)           # sent: |u| >= 0.40625 -> 4, -2, 0.5
    out = torch.zeros(16)
    ops.decode(out, msg)
    s = 6.5 / 3
    assert out[:4].tolist() == pytest.approx([s, -s, s, 0.0])
    assert r[:3].tolist() == pytest.approx([4 - s, -2 + s, 0.5 - s])


VALUES_OF = {"topk": "bf16", "topk8": "int8", "topk_sign": "sign"}


@pytest.mark.parametrize("kind", ["topk", "topk8", "topk_sign", "ternary"])
def test_same_result_for_any_thread_count(kind):
    update, residual = _state(300_000, seed=3)
    results = []
    for t in (1, 2, 3):
        gradshare.set_num_threads(t)
        r = residual.clone()
        m = (ops.encode_ternary(update, r) if kind == "ternary" else
             ops.encode_topk(update, r, 41, values=VALUES_OF[kind]))
        results.append((m, r))
    gradshare.set_num_threads(2)
    for m, r in results[1:]:
        assert_bits_equal(m, results[0][0])
        assert_bits_equal(r, results[0][1])


@pytest.mark.parametrize("kind", ["topk", "topk_sign", "ternary"])
@pytest.mark.parametrize("n,where", [(1, [0]), (17, [16]), (3 * 4096 + 9, [2 * 4096 + 3, 4096 + 1])])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gives_a_marker_of_the_same_length_and_keeps_the_residual(kind, n, where, bad):
    update, residual = _state(n, ties=False)
    for i in where:
        update[i] = bad
    r = residual.clone()
    m = ops.encode_ternary(update, r) if kind == "ternary" else ops.encode_topk(update, r, 41, values=VALUES_OF[kind])
    words = (M.ternary_words(n, 4096) if kind == "ternary"
             else M.chunked_words(ops.TOPK_VALUES[VALUES_OF[kind]], n, 4096, 41))
    assert m.numel() == words and int(m[1]) == M.NONFINITE and int(m[3]) == min(where)
    assert torch.equal(m[M.HEADER_WORDS:], torch.zeros(words - M.HEADER_WORDS, dtype=torch.int32))
    assert_bits_equal(r, residual)
    with pytest.raises(MessageError, match="non-finite marker"):
        ops.decode(torch.zeros(n), m)


def test_overflowing_sum_is_nonfinite_too():
    update, residual = torch.full((32,), 3e38), torch.full((32,), 3e38)
    r = residual.clone()
    assert int(ops.encode_ternary(update, r, chunk=16)[1]) == M.NONFINITE
    assert_bits_equal(r, residual)


def test_bf16_rounding_never_overflows():
    u = torch.tensor([3.4e38, -3.4e38, 1.0, 0.0])
    r = torch.zeros(4)
    msg = ops.encode_topk(u, r, 4, chunk=4)
    out = torch.zeros(4)
    ops.decode(out, msg)
    assert torch.isfinite(out).all() and torch.isfinite(r).all()
    assert torch.equal(out + r, u)


@pytest.mark.parametrize("kind", ["topk", "topk_sign", "ternary"])
@pytest.mark.parametrize("scale", [1.0, 0.5, -1 / 3])
def test_decode_of_several_rows_matches_reference(kind, scale):
    rows = []
    for seed in range(3):
        update, residual = _state(10_000, seed=seed)
        rows.append(ops.encode_ternary(update, residual) if kind == "ternary"
                    else ops.encode_topk(update, residual, 41, values=VALUES_OF[kind]))
    rows = torch.stack(rows)
    wide = torch.cat([rows, torch.randint(-9, 9, (3, 7), dtype=torch.int32)], dim=1)   # padded rows decode too
    for r in (rows, wide):
        d1 = torch.randn(10_000)
        d2 = d1.clone()
        ops.decode(d1, r, scale=scale)
        R.decode(d2, r, scale)
        assert_bits_equal(d1, d2)


@pytest.mark.parametrize("kind", ["ternary", "bitmap"])
def test_decode_leaves_what_a_message_does_not_send_bit_for_bit(kind):
    # Code words are applied with masks over all 16 elements: an element not sent keeps its exact bits
    # (-0.0, subnormals, NaN payloads), a sent one gets dst + v as the reference adds it.
    n = 4099
    g = torch.Generator().manual_seed(3)
    update = torch.randn(n, generator=g)
    update[::3] = 0.0                                      # never sent
    msg = (ops.encode_ternary(update, torch.zeros(n), 0.5, chunk=64) if kind == "ternary"
           else ops.encode(update, torch.zeros(n), 0.5, format="bitmap"))
    dst = torch.randn(n, generator=g)
    dst[::3] = -0.0
    dst[1::9] = 1e-40                                      # subnormal
    dst[2::27] = torch.tensor([0x7fc00123], dtype=torch.int32).view(torch.float32)  # a NaN with a payload
    want = dst.clone()
    R.decode(want, msg.view(1, -1), 1.0)
    ops.decode(dst, msg)
    assert_bits_equal(dst, want)
    assert_bits_equal(dst[::3], torch.full((len(range(0, n, 3)),), -0.0))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3000), st.sampled_from([1, 3, 16, 48, 256, 1024, 65536]), st.floats(0.0, 1.0),
       st.integers(0, 2**31 - 1))
def test_property_topk_signs_match_the_reference_and_decode_to_what_was_taken(n, chunk, density, seed):
    update, residual = _state(n, seed=seed)
    k = min(chunk, int(density * chunk))
    msg, out, u = _signs_round_trip(update, residual, k, chunk)
    for lo in range(0, n, chunk):                            # each chunk sends its k_c largest
        kc = (k * min(chunk, n - lo) + chunk - 1) // chunk
        assert int((out[lo:lo + chunk] != 0).sum()) <= kc


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3000), st.sampled_from([16, 48, 256, 1024]), st.floats(0.001, 1.0), st.integers(0, 2**31 - 1))
def test_property_topk_error_feedback_is_exact(n, chunk, density, seed):
    update, residual = _state(n, seed=seed)
    k = max(1, min(chunk, int(density * chunk)))
    msg, kept = _both(_topk, R.encode_topk, update, residual, k, chunk)
    out = torch.zeros(n)
    ops.decode(out, msg)
    assert torch.equal(out + kept, residual + update)
    # every chunk sent its share, and nothing it kept is larger than what it sent
    for lo in range(0, n, chunk):
        sent, left = out[lo:lo + chunk] != 0, kept[lo:lo + chunk].abs()
        if sent.any() and (~sent).any():
            assert left[~sent].max() <= (residual + update)[lo:lo + chunk].abs()[sent].min()


# -------------------------------------------------------------------------------------------- hostile input
def _valid(kind, n=10_000, seed=0):
    update, residual = _state(n, seed=seed)
    if kind == "ternary":
        return ops.encode_ternary(update, residual)
    return ops.encode_topk(update, residual, 41, values=VALUES_OF[kind])


def _verdict(fn, n, msg):
    dst = torch.randn(n, generator=torch.Generator().manual_seed(n))
    before = dst.clone()
    try:
        fn(dst, msg)
    except (MessageError, ValueError) as e:
        assert_bits_equal(dst, before)          # a refused message writes nothing
        return "refused", str(e)
    return "accepted", dst


@pytest.mark.parametrize("kind", ["topk", "topk8", "topk_sign", "ternary"])
def test_fuzz_mutated_messages(kind):
    """Each mutation is either refused by both decoders (dst untouched) or accepted by both, with one result."""
    rng = np.random.default_rng(1)
    base = _valid(kind)
    n = 10_000
    refused = accepted = 0
    for trial in range(600):
        msg = base.clone()
        for _ in range(rng.integers(1, 4)):
            i = int(rng.integers(0, msg.numel()))
            how = rng.integers(0, 4)
            if how == 0:
                msg[i] = int(rng.integers(-2**31, 2**31, dtype=np.int64))
            elif how == 1:                                     # flip one bit (as int32)
                x = (int(msg[i]) & 0xFFFFFFFF) ^ (1 << int(rng.integers(0, 32)))
                msg[i] = x - 2**32 if x >= 2**31 else x
            elif how == 2:
                msg[i] = msg[int(rng.integers(0, msg.numel()))]
            else:
                msg[int(rng.integers(0, 5))] = int(rng.choice([0, -1, 1, 16, 4096, 65536, n, n + 1, 2**31 - 1]))
        a = _verdict(ops.decode, n, msg)
        b = _verdict(lambda d, m: R.decode(d, m), n, msg)
        assert a[0] == b[0], (trial, a, b)
        if a[0] == "accepted":
            assert_bits_equal(a[1], b[1])
            accepted += 1
        else:
            refused += 1
    assert refused > 100 and accepted > 10


@pytest.mark.parametrize("kind", ["topk", "topk8", "topk_sign", "ternary"])
def test_truncated_rows_are_refused(kind):
    msg = _valid(kind)
    for cut in (0, 3, 5, msg.numel() // 2, msg.numel() - 1):
        with pytest.raises((MessageError, ValueError)):
            ops.decode(torch.zeros(10_000), msg[:cut] if cut else msg[:0].view(1, 0))


def test_hostile_headers_are_refused():
    n = 4096
    topk, tern = _valid("topk", n), _valid("ternary", n)
    cases = []
    for field, value in ((2, n + 1), (3, 0), (3, 70000), (4, -1), (4, 4097)):
        m = topk.clone()
        m[field] = value
        cases.append(m)
    for field, value in ((3, 8), (3, 24), (4, n + 1), (4, -1)):
        m = tern.clone()
        m[field] = value
        cases.append(m)
    m = topk.clone()
    m[5] = (0x7F80 << 16) | 3                                 # an infinite value
    cases.append(m)
    m = tern.clone()
    m[5] = M.float_bits(-1.0)                                 # a negative scale
    cases.append(m)
    t8 = _valid("topk8", n)
    for word, value in ((5, M.float_bits(float("inf"))), (6, 0x00050005),   # an infinite scale; repeated index
                        (5 + 1 + 21, 0x80)):                                  # q = -128
        m = t8.clone()
        m[word] = value
        cases.append(m)
    ts = _valid("topk_sign", n)                               # one chunk: scale at 5, the stream from 6
    kc, low = 41, M.ef_low_bits(4096, 41)
    high = kc * low                                           # the first high bit
    for word, value in ((5, M.float_bits(float("nan"))), (5, M.float_bits(-2.0)),
                        (6 + high // 32, int(ts[6 + high // 32]) ^ (1 << (high % 32))),   # an entry's high bit gone
                        (ts.numel() - 1, int(ts[-1]) | -2**31)):                          # a bit past the stream
        m = ts.clone()
        m[word] = value
        cases.append(m)
    m = ts.clone()
    m[6:6 + (kc * low) // 32] = -1                            # low bits all ones: indices repeat or leave the chunk
    cases.append(m)
    for m in cases:
        dst = torch.randn(n)
        before = dst.clone()
        with pytest.raises(MessageError):
            ops.decode(dst, m)
        assert_bits_equal(dst, before)
        with pytest.raises(ValueError):
            R.decode(dst.clone(), m)


def test_value_times_scale_overflow_is_refused():
    u = torch.tensor([3e38] + [0.0] * 15)
    msg = ops.encode_topk(u, torch.zeros(16), 1, chunk=16)
    with pytest.raises(MessageError, match="overflows"):
        ops.decode(torch.zeros(16), msg, scale=10.0)


# -------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("args,exc,pattern", [
    ((10, 4096), None, None),
    ((-1, 4096), ValueError, "k:"),
    ((4097, 4096), ValueError, "k:"),
    ((1.5, 4096), ValueError, "k:"),
    ((1, 0), ValueError, "chunk"),
    ((1, 70000), ValueError, "chunk"),
    ((1, 16.0), TypeError, "chunk"),
])
def test_topk_argument_checks(args, exc, pattern):
    u, r = torch.zeros(100), torch.zeros(100)
    if exc is None:
        ops.encode_topk(u, r, args[0], chunk=args[1])
        return
    with pytest.raises(exc, match=pattern):
        ops.encode_topk(u, r, args[0], chunk=args[1])


@pytest.mark.parametrize("fraction,chunk,exc,pattern", [
    (-0.5, 4096, ValueError, "fraction"), (float("nan"), 4096, ValueError, "fraction"),
    ("x", 4096, TypeError, "fraction"), (0.5, 24, ValueError, "multiple of 16"), (0.5, 8, ValueError, "chunk"),
])
def test_ternary_argument_checks(fraction, chunk, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ops.encode_ternary(torch.zeros(100), torch.zeros(100), fraction, chunk=chunk)


def test_update_residual_checks_apply():
    with pytest.raises(ValueError, match="residual"):
        ops.encode_topk(torch.zeros(10), torch.zeros(11), 1)
    with pytest.raises(TypeError, match="residual"):
        ops.encode_ternary(torch.zeros(10), torch.zeros(10, dtype=torch.float64))
    u = torch.zeros(10)
    with pytest.raises(ValueError, match="shares memory"):
        ops.encode_topk(u, u, 1)


@pytest.mark.parametrize("op,args", [
    ("encode_topk", lambda u, r: (u, r, 7, 64, M.TOPK)),
    ("encode_topk", lambda u, r: (u, r, 7, 64, M.TOPK8)),
    ("encode_topk", lambda u, r: (u, r, 7, 64, M.TOPKSIGN)),
    ("encode_ternary", lambda u, r: (u, r, 0.5, 64)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(op, args, dtype):
    u, r = _state(300, dtype)
    torch.library.opcheck(getattr(torch.ops.gradshare, op), args(u, r),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_compiled_encode_matches_eager():
    u, r = _state(5000)

    def f(u, r):
        return ops.encode_topk(u, r, 41), ops.encode_ternary(u * 2, r.clone())

    r1, r2 = r.clone(), r.clone()
    a = f(u, r1)
    b = torch.compile(f, backend="eager", fullgraph=False)(u, r2)
    for x, y in zip(a, b):
        assert_bits_equal(x, y)
    assert_bits_equal(r1, r2)


def test_compiled_encode_with_dynamic_sizes_matches_eager():
    # The fake kernels size the message from SymInts (divmod refused them)
    torch._dynamo.reset()

    def f(u, r):
        return ops.encode_topk(u, r, 41, values="int8"), ops.encode_ternary(u * 2, r.clone())

    g = torch.compile(f, backend="aot_eager", dynamic=True)
    for n in (5000, 7001):
        u, r = _state(n)
        r1, r2 = r.clone(), r.clone()
        for x, y in zip(f(u, r1), g(u, r2)):
            assert_bits_equal(x, y)
        assert_bits_equal(r1, r2)


@pytest.mark.parametrize("kind,n", list(itertools.product(["topk", "ternary"], [1, 100])))
def test_numpy_inputs(kind, n):
    update, residual = _state(n)
    u, r = update.numpy(), residual.numpy().copy()
    m = ops.encode_topk(u, r, 1) if kind == "topk" else ops.encode_ternary(u, r)
    r2 = residual.clone()
    m2 = ops.encode_topk(update, r2, 1) if kind == "topk" else ops.encode_ternary(update, r2)
    assert_bits_equal(torch.as_tensor(m), m2)
    assert_bits_equal(torch.from_numpy(r), r2)
