"""gradshare.ops against gradshare.reference, bit for bit, plus property, determinism, non-finite,
custom-op (opcheck) and torch.compile tests."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradshare
from gradshare import message as msgfmt
from gradshare import ops, reference
from gradshare.message import BITMAP, NONFINITE, SPARSE
from op_inputs import (TRACKED_FORMS, assert_bits_equal, bits, global_batch_step_case, make_state,
                       tracked_step_case)

CHUNK = 2**15  # csrc/cpu/parallel.h: kChunk; kParallelMin = 2 * kChunk
SIZES = [0, 1, 2, 15, 16, 17, 31, 33, 1000, 1023, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1, 2 * CHUNK,
         2 * CHUNK + 1, 3 * CHUNK + 17]
BIG = 2**20 + 7
FORMATS = ["auto", "sparse", "bitmap"]


@pytest.fixture
def threads():
    before = gradshare.get_num_threads()
    yield gradshare.set_num_threads
    gradshare.set_num_threads(before)


def check_encode(update, residual, tau, clip=None, fmt="auto"):
    r_nat, r_ref = residual.clone(), residual.clone()
    m_nat = ops.encode(update, r_nat, tau, clip=clip, format=fmt)
    m_ref = reference.encode(update, r_ref, tau, clip, fmt)
    assert m_nat.dtype == torch.int32 and m_nat.dim() == 1
    assert_bits_equal(m_nat, m_ref)
    assert_bits_equal(r_nat, r_ref)
    return m_nat, r_nat


# ---------------------------------------------------------------------------------------------------
# encode / count / decode / average against the reference
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("density", [0.001, 0.05, 0.5])
def test_encode_matches_reference_sizes(n, fmt, density):
    update, residual = make_state(n, density, seed=n)
    msg, _ = check_encode(update, residual, 1.0, fmt=fmt)
    info = msgfmt.parse_header(msg)
    assert info.n == n and info.tau == 1.0
    if fmt != "auto":
        assert info.format == (SPARSE if fmt == "sparse" else BITMAP)
    else:
        assert info.format == (SPARSE if msgfmt.prefer_sparse(info.count, n) else BITMAP)
    assert msg.numel() == info.words


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tau", [1e-40, 1e-3, 0.37, 1.0, 12.5])
@pytest.mark.parametrize("clip", [None, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("fmt", FORMATS)
def test_encode_matches_reference_dtypes_taus_clip(dtype, tau, clip, fmt):
    n = 2 * CHUNK + 5
    update, residual = make_state(n, 0.03, dtype=dtype, seed=7, tau=tau)
    residual = residual * 3  # some kept values beyond the clip bound
    check_encode(update, residual, tau, clip=clip, fmt=fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clip", [None, 2.0])
def test_encode_matches_reference_large(fmt, dtype, clip):
    update, residual = make_state(BIG, 0.01, dtype=dtype, seed=3)
    check_encode(update, residual, 1.0, clip=clip, fmt=fmt)


def test_encode_exact_threshold_and_signed_zero():
    tau = 0.5
    residual = torch.tensor([0.25, -0.25, 0.0, -0.0, 0.5, -0.5, 0.25, -0.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                             0.0])
    update = torch.tensor([0.25, -0.25, 0.5, -0.5, 0.0, -0.0, 0.2499999, -0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                           0.0])
    for fmt in FORMATS:
        msg, r = check_encode(update, residual, tau, fmt=fmt)
        assert msgfmt.parse_header(msg).count == 8
    msg, r = check_encode(update, residual, tau, fmt="sparse")
    assert msg[5:].tolist() == [1, -2, 3, -4, 5, -6, 9, -10]
    assert bits(r)[7] == bits(torch.tensor(-0.0)) and r[8] == 0.5 and r[9] == -0.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_encode_converts_every_half_value_exactly(dtype):
    """Every finite fp16 / bf16 bit pattern (subnormals included) widens to float32 exactly as torch does."""
    pattern = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    update = pattern[torch.isfinite(pattern)].contiguous()
    residual = torch.zeros(update.numel())
    tau = float(torch.finfo(torch.float32).max)  # nothing reaches it: the residual becomes the update
    msg, r = check_encode(update, residual, tau)
    assert_bits_equal(r, 0.0 + update.float())  # 0.0 + -0.0 is +0.0
    assert_bits_equal(r[r != 0], update.float()[r != 0])
    assert msgfmt.parse_header(msg).count == 0


@pytest.mark.parametrize("n", SIZES + [BIG])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_count_matches_reference(n, dtype):
    update, residual = make_state(n, 0.02, dtype=dtype, seed=n + 1)
    before = residual.clone()
    c = ops.count(update, residual, 1.0)
    assert isinstance(c, int)
    assert c == reference.count(update, residual, 1.0)[0]
    assert_bits_equal(residual, before)  # read-only
    m = ops.encode(update, residual.clone(), 1.0)
    assert c == msgfmt.parse_header(m).count


def _messages(n, k, seed):
    msgs = []
    for j in range(k):
        update, residual = make_state(n, [0.002, 0.3, 0.04][j % 3], seed=seed + j, tau=0.25 * (j + 1))
        msgs.append(ops.encode(update, residual, 0.25 * (j + 1), format=FORMATS[j % 3]))
    return msgs


@pytest.mark.parametrize("n", SIZES + [BIG])
@pytest.mark.parametrize("scale", [1.0, 0.25, -1 / 3])
def test_decode_matches_reference(n, scale):
    msgs = _messages(n, 3, seed=n)
    dst0 = torch.randn(n, generator=torch.Generator().manual_seed(n))
    for messages in (msgs[0], msgs, torch.stack([torch.nn.functional.pad(m, (0, max(x.numel() for x in msgs) -
                                                                             m.numel())) for m in msgs])):
        d_nat, d_ref = dst0.clone(), dst0.clone()
        ops.decode(d_nat, messages, scale=scale)
        reference.decode(d_ref, messages, scale)
        assert_bits_equal(d_nat, d_ref)


def test_decode_empty_message_list_is_a_no_op():
    dst = torch.randn(10)
    before = dst.clone()
    ops.decode(dst, [])
    assert_bits_equal(dst, before)


def test_decode_padded_row_with_trailing_words():
    update, residual = make_state(100, 0.05)
    m = ops.encode(update, residual, 1.0, format="sparse")
    row = torch.cat([m, torch.full((7,), 123456, dtype=torch.int32)])  # words past the message are ignored
    a, b = torch.zeros(100), torch.zeros(100)
    ops.decode(a, row)
    ops.decode(b, m)
    assert_bits_equal(a, b)
    assert a.abs().sum() > 0


@pytest.mark.parametrize("n", [0, 1, 17, 2047, 2048, 2049, 2 * CHUNK + 1, BIG])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("weighted", [False, True])
def test_average_matches_reference(n, k, weighted):
    g = torch.Generator().manual_seed(n + k)
    bufs = [torch.randn(n, generator=g) for _ in range(k)]
    weights = [float(w) for w in torch.rand(k, generator=g) * 2 - 0.5] if weighted else None
    out = ops.average(bufs, weights=weights)
    assert_bits_equal(out, reference.average(bufs, weights))


@pytest.mark.parametrize("alias", [0, 2])
@pytest.mark.parametrize("weighted", [False, True])
def test_average_in_place(alias, weighted):
    g = torch.Generator().manual_seed(alias)
    bufs = [torch.randn(2 * CHUNK + 3, generator=g) for _ in range(3)]
    weights = [0.2, 0.3, 0.5] if weighted else None
    expected = reference.average(bufs, weights)
    res = ops.average(bufs, weights=weights, out=bufs[alias])
    assert res is bufs[alias]
    assert_bits_equal(bufs[alias], expected)


def test_average_into_given_out():
    bufs = [torch.randn(1000) for _ in range(4)]
    out = torch.full((1000,), float("nan"))
    assert ops.average(bufs, out=out) is out
    assert_bits_equal(out, reference.average(bufs))


GBS_FORMS = ["adam", "change", "change_decay", "adam_signal", "change_decay_signal"]


def _cloned(kw):
    """The case's keywords with its signal (which the op writes) cloned."""
    return dict(kw, signal=kw["signal"].clone()) if "signal" in kw else dict(kw)


@pytest.mark.parametrize("n", [0, 1, 17, 2 * CHUNK + 1, BIG])
@pytest.mark.parametrize("form", GBS_FORMS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("world", [1, 2, 7])
def test_global_batch_step_matches_reference(n, form, sign, world):
    m, v, kw = global_batch_step_case(form, n, seed=n + world, world=world, edge=True, nonfinite=True)
    target = torch.randn(n)
    expected, original = target.clone(), target.clone()
    ref_kw, op_kw = _cloned(kw), _cloned(kw)
    reference.global_batch_step(m, v, expected, sign=sign, **ref_kw)
    ops.global_batch_step(m, v, target, sign=sign, **op_kw)
    assert_bits_equal(target, expected)
    if "signal" in kw:                  # the average of m^2 moved, alike
        assert_bits_equal(op_kw["signal"], ref_kw["signal"])
        assert n == 0 or not torch.equal(op_kw["signal"], kw["signal"])
    if world == 1 and n >= 8:        # one rank: its own batch is the global batch, nothing changes but roundings
        squared = (m / kw["bias1"]) ** 2 if "signal" not in kw else ref_kw["signal"] / kw["signal_bias"]
        steady = squared <= v / kw["bias2"]     # (else v_global = the squared mean > v, whatever W)
        torch.testing.assert_close(target[8:][steady[8:]], original[8:][steady[8:]], rtol=1e-6, atol=1e-9)
    elif n >= 8:
        assert not torch.equal(target[8:], original[8:])


@pytest.mark.parametrize("form", GBS_FORMS)
@pytest.mark.parametrize("world,noise", [(2, 0.05), (7, 0.1), (2, 0.5), (2, 1.0)])
def test_global_batch_step_with_noise_matches_reference(form, world, noise):
    """The share of noise in the squared mean (gradshare.second_moment) moves v_global down to s + (v - s) *
    (1/W - noise) / (1 - noise), never below s (noise >= 1/W: v_global = s); bit for bit with the reference,
    with the native library and without it, edge and non-finite values too; the steps only grow."""
    n = 2 * CHUNK + 9
    m, v, kw = global_batch_step_case(form, n, seed=11 + world, world=world, edge=True, nonfinite=True)
    plain, expected, target = torch.zeros(n), torch.zeros(n), torch.zeros(n)     # each ends as its excess
    ref_kw, op_kw, plain_kw = _cloned(kw), _cloned(kw), _cloned(kw)
    reference.global_batch_step(m, v, expected, noise=noise, **ref_kw)
    ops.global_batch_step(m, v, target, noise=noise, **op_kw)
    assert_bits_equal(target, expected)
    if "signal" in kw:
        assert_bits_equal(op_kw["signal"], ref_kw["signal"])
    ops.global_batch_step(m, v, plain, **plain_kw)                  # without the noise counted
    finite = (torch.isfinite(target) & torch.isfinite(plain))[16:]
    assert bool((target[16:][finite].abs() >= plain[16:][finite].abs() * (1 - 1e-6)).all())
    assert not torch.equal(target[16:], plain[16:])
    if noise >= 1.0 / world:             # v_global = s: the change's divisor is sqrt(s) + eps
        assert reference.effective_world(world, noise) == reference.FLOAT_MAX


def test_global_batch_steps_take_the_effective_world():
    """The batched form takes the divisor itself (gradshare.reference.effective_world): the same bits as one call
    with ``noise``, native and through the op's fallback."""
    m, v, kw = global_batch_step_case("adam_signal", 1000, seed=3, world=3)
    one, many = torch.randn(1000), None
    many = one.clone()
    one_kw, many_kw = _cloned(kw), _cloned(kw)
    ops.global_batch_step(m, v, one, noise=0.08, **one_kw)
    ops.global_batch_steps([(m, v, many, None, None, many_kw["signal"], kw["bias1"], kw["bias2"],
                             reference.effective_world(3, 0.08), kw["eps"], kw["lr"], 0.0, 1.0, kw["signal_weight"],
                             kw["signal_bias"])])
    assert_bits_equal(many, one)
    assert reference.effective_world(3, 0.0) == 3                   # exactly W without noise
    assert reference.effective_world(2, 0.05) == pytest.approx(1 / ((0.5 - 0.05) / 0.95))


@pytest.mark.parametrize("kind,variant", [("rmsprop", "signal"), ("adagrad", "plain"), ("rmsprop", "centered"),
                                          ("adamax", "signal"), ("adafactor", "decay_signal")])
@pytest.mark.parametrize("noise", [0.06, 0.9])
def test_global_batch_step_tracked_with_noise_matches_reference(kind, variant, noise, monkeypatch):
    """The same for the optimizers whose mean gradient gradshare keeps; Adamax's and Adafactor's floor of
    v_global / v stays 1 / W however much noise is counted. The op's fallback passes both on."""
    from gradshare import _native
    n = 2 * CHUNK + 3
    grad, change, mean, kw = tracked_step_case(kind, variant, n, seed=7, world=4, edge=True, nonfinite=True)
    results = []
    for run in ("reference", "native", "fallback"):
        target, m, k = torch.randn(n, generator=torch.Generator().manual_seed(1)), mean.clone(), _cloned(kw)
        if "extra" in k:
            k["extra"] = k["extra"].clone()
        if run == "reference":
            reference.global_batch_step_tracked(grad, change, m, target, noise=noise, **k)
        else:
            if run == "fallback":
                monkeypatch.setattr(_native, "available", lambda: False)
            ops.global_batch_step_tracked(grad, change, m, target, noise=noise, **k)
        results.append((target, m))
    for target, m in results[1:]:
        assert_bits_equal(target, results[0][0])
        assert_bits_equal(m, results[0][1])
    plain, k = torch.randn(n, generator=torch.Generator().manual_seed(1)), _cloned(kw)
    if "extra" in k:
        k["extra"] = k["extra"].clone()
    ops.global_batch_step_tracked(grad, change, mean.clone(), plain, **k)
    assert not torch.equal(results[0][0][16:], plain[16:])
    if kind in ("adamax", "adafactor"):      # r >= 1 / sqrt(W): the step at most sqrt(W) times the rank's own
        divided = change.clone()
        if "decay" in variant:
            divided = change - (kw["after"] + change) * kw["decay"]
        excess, k = torch.zeros(n), _cloned(kw)
        k["extra"] = k["extra"].clone()
        ops.global_batch_step_tracked(grad, change, mean.clone(), excess, noise=noise, **k)
        ratio = (excess / divided)[16:]
        ok = torch.isfinite(ratio) & (divided[16:].abs() > 1e-6)
        assert float(ratio[ok].max()) <= 4 ** 0.5 - 1 + 1e-4
        assert float(ratio[ok].max()) > 0.5           # and reaches it where noise dominates


@pytest.mark.parametrize("leaves_as_is", [True, False])
def test_global_batch_step_refuses_a_noise_out_of_range(leaves_as_is):
    m, v, kw = global_batch_step_case("adam", 10, seed=1)
    target = torch.randn(10)
    before = target.clone()
    with pytest.raises(ValueError, match=r"^noise: the share of the gradient's variance in the squared mean, in "
                                         r"\[0, 1\]; got (-0.1|1.5)"):
        ops.global_batch_step(m, v, target, noise=-0.1 if leaves_as_is else 1.5, **kw)
    grad, change, mean, tkw = tracked_step_case("rmsprop", "plain", 10, seed=1)
    with pytest.raises(ValueError, match=r"^noise: "):
        ops.global_batch_step_tracked(grad, change, mean, target, noise=float("nan"), **tkw)
    assert torch.equal(target, before)


@pytest.mark.parametrize("form", GBS_FORMS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_global_batch_step_leaves_a_step_whose_second_moment_overflows(form, sign):
    """exp_avg_sq / bias2 past float32's range: the rank's step divided by inf and so did the global batch's, so
    nothing is added, in every form (never inf / inf's NaN into the parameters); the kernel and its reference."""
    m, v, kw = global_batch_step_case(form, 300, seed=5)
    v[::3] = 1e37                                       # / bias2 (0.00299) overflows
    for op in (ops.global_batch_step, reference.global_batch_step):
        target = torch.randn(300, generator=torch.Generator().manual_seed(1))
        original = target.clone()
        op(m, v, target, sign=sign, **_cloned(kw))
        assert torch.isfinite(target).all()
        assert torch.equal(target[::3], original[::3])
        assert not torch.equal(target, original)     # the other elements still get their excess


@pytest.mark.parametrize("alias", ["change", "after"])
def test_global_batch_step_in_place(alias):
    """The sharing core rescales its change buffer in place, local steps the parameters (also ``after``)."""
    n = 2 * CHUNK + 5
    m, v, kw = global_batch_step_case("change_decay", n, seed=3)
    target = kw[alias].clone()
    expected = target.clone()
    ref_kw = dict(kw, **{alias: expected.clone()})
    reference.global_batch_step(m, v, expected, sign=1.0 if alias == "change" else -1.0, **ref_kw)
    ops.global_batch_step(m, v, target, sign=1.0 if alias == "change" else -1.0, **dict(kw, **{alias: target}))
    assert_bits_equal(target, expected)
    assert not torch.equal(target, kw[alias])


def _steps_case():
    """(per-step keyword calls, the same as gradshare.ops.global_batch_steps' tuples): every form, sizes from 0
    to past a parallel chunk, one step rescaling its change in place."""
    calls = []
    for i, (form, n) in enumerate([("adam", 17), ("change", 0), ("change_decay", 2 * CHUNK + 1), ("adam_signal", 1),
                                   ("change_decay_signal", 300), ("adam", 1000)]):
        m, v, kw = global_batch_step_case(form, n, seed=40 + i, world=2 + i % 3, edge=True, nonfinite=True)
        target = kw["change"].clone() if i == 4 else torch.randn(n, generator=torch.Generator().manual_seed(i))
        calls.append((m, v, target, dict(kw, change=target) if i == 4 else kw, -1.0 if i % 2 else 1.0))
    return calls


def _as_tuple(m, v, target, kw, sign):
    return (m, v, target, kw.get("change"), kw.get("after"), kw.get("signal"), kw["bias1"], kw["bias2"],
            kw["world"], kw["eps"], kw.get("lr", 0.0), kw.get("decay", 0.0), sign, kw.get("signal_weight", 0.0),
            kw.get("signal_bias", 1.0))


@pytest.mark.parametrize("native", [True, False])
def test_global_batch_steps_are_one_global_batch_step_each(native, monkeypatch):
    """The sharing core rescales a bucket's parameters in one call: the same bits as one call per parameter,
    with the native library and through the reference (where it is missing)."""
    expected = _steps_case()
    for m, v, target, kw, sign in expected:
        ops.global_batch_step(m, v, target, sign=sign, **kw)
    got = _steps_case()
    if not native:
        monkeypatch.setattr(gradshare._native, "available", lambda: False)
    ops.global_batch_steps([_as_tuple(*c) for c in got])
    for (_, _, want, kw_want, _), (_, _, have, kw_have, _) in zip(expected, got):
        assert_bits_equal(have, want)
        if "signal" in kw_want:
            assert_bits_equal(kw_have["signal"], kw_want["signal"])
    ops.global_batch_steps([])                                      # nothing to do


def test_global_batch_steps_refuse_operands_that_do_not_fit_and_write_nothing():
    calls = _steps_case()
    before = [c[2].clone() for c in calls]
    short = [_as_tuple(*c) for c in calls]
    short[3] = (short[3][0], short[3][1][:0]) + short[3][2:]               # exp_avg_sq shorter than its target
    wide = [_as_tuple(*c) for c in calls]
    wide[2] = (wide[2][0].double(),) + wide[2][1:]
    for bad, what in ((short, "0 elements"), (wide, "float64"), ([_as_tuple(*calls[0])[:14]], "15 arguments")):
        with pytest.raises(ValueError, match=what):
            ops.global_batch_steps(bad)
    for c, b in zip(calls, before):
        assert_bits_equal(c[2], b)


def _scale_case(bad_at=None, bad=float("nan")):
    """Sources (sizes 0 to past a parallel chunk, subnormals, -0, the largest float) and their destinations."""
    g = torch.Generator().manual_seed(5)
    srcs = [torch.randn(n, generator=g) for n in (17, 0, 2 * CHUNK + 1, 1, BIG)]
    srcs[0][:4] = torch.tensor([-0.0, 1e-40, -3e-39, torch.finfo(torch.float32).max])
    if bad_at is not None:
        srcs[bad_at[0]][bad_at[1]] = bad
    return [torch.full_like(x, 7.0) for x in srcs], srcs


@pytest.mark.parametrize("native", [True, False])
def test_scale_into_is_the_scaled_copy_and_its_check(native, monkeypatch, threads):
    """The all-reduced sum scaled to the mean straight into the gradients: the same bits as src * scale in
    float32 (the reference), the check of what was written, with the native library and without."""
    if not native:
        monkeypatch.setattr(gradshare._native, "available", lambda: False)
    for t in (1, 2):
        threads(t)
        for scale in (0.5, 1.0 / 3.0, 1.0):
            dsts, srcs = _scale_case()
            before = [x.clone() for x in srcs]
            assert ops.scale_into(dsts, srcs, scale).tolist() == [0.0]
            for d, x, b in zip(dsts, srcs, before):
                assert_bits_equal(d, x * np.float32(scale))
                assert_bits_equal(x, b)                       # the sources are only read
        for where in ((0, 16), (2, CHUNK + 3), (4, BIG - 1), (3, 0)):
            for bad in (float("nan"), float("inf"), float("-inf")):
                dsts, srcs = _scale_case(where, bad)
                assert ops.scale_into(dsts, srcs, 0.5).tolist() == [1.0], (where, bad)
                assert_bits_equal(dsts[where[0]], srcs[where[0]] * np.float32(0.5))
    dsts, srcs = _scale_case()                                      # the largest float doubled: an overflow
    assert ops.scale_into(dsts, srcs, 2.0).tolist() == [1.0]
    assert_bits_equal(dsts[0], srcs[0] * np.float32(2.0))
    assert ops.scale_into(dsts[1:], srcs[1:], 2.0).tolist() == [0.0]
    dsts, srcs = _scale_case()
    assert ops.scale_into(srcs, srcs, 0.25).tolist() == [0.0]      # in place: each its own source
    assert_bits_equal(srcs[2], _scale_case()[1][2] * np.float32(0.25))
    assert ops.scale_into([], [], 0.5).tolist() == [0.0]


def test_scale_into_takes_other_layouts_and_refuses_what_does_not_fit():
    src = torch.randn(6, 4)
    dst = torch.zeros(4, 6).t()                                    # a strided gradient: the reference writes it
    assert ops.scale_into([dst], [src.reshape(-1)], 0.5).tolist() == [0.0]
    assert_bits_equal(dst.contiguous(), src * np.float32(0.5))
    dst = torch.zeros(5)
    for dsts, srcs, scale, what in (([dst], [torch.ones(6)], 0.5, "5 elements"),
                                    ([dst.double()], [torch.ones(5).double()], 0.5, "float32"),
                                    ([dst], [torch.ones(5), torch.ones(5)], 0.5, "1 destinations for 2"),
                                    ([dst], [torch.ones(5)], float("inf"), "finite")):
        with pytest.raises(ValueError, match=what):
            ops.scale_into(dsts, srcs, scale)
        assert not dst.any()                                       # nothing written


def test_global_batch_step_threads_agree(threads):
    m, v, kw = global_batch_step_case("adam", BIG, seed=9)
    out = []
    for t in (1, 2, 4):
        threads(t)
        target = torch.zeros(BIG)
        ops.global_batch_step(m, v, target, **kw)
        out.append(target)
    assert_bits_equal(out[0], out[1])
    assert_bits_equal(out[0], out[2])


def test_global_batch_step_is_the_step_with_the_global_second_moment():
    """The rule itself, in float64: the rank's change (before - after) lr m / (sqrt(v) + eps) plus the excess
    is lr m / (sqrt(v_global) + eps), v_global = m^2 + max(v - m^2, 0) / W."""
    m, v, kw = global_batch_step_case("adam", 4096, seed=4, world=4)
    md, vd = m.double() / kw["bias1"], v.double() / kw["bias2"]
    vg = md * md + (vd - md * md).clamp_min(0) / 4
    own = kw["lr"] * md / (vd.sqrt() + kw["eps"])
    target = own.float()
    ops.global_batch_step(m, v, target, **kw)
    torch.testing.assert_close(target.double(), kw["lr"] * md / (vg.sqrt() + kw["eps"]), rtol=1e-5, atol=1e-12)
    assert (vg < vd).any()                   # noise-dominated entries: the global step is larger


def test_global_batch_step_keeps_the_average_squared_mean_whole():
    """With gradshare's average of m^2 (signal): signal += (m^2 - signal) * weight, and v_global = s + max(v - s,
    0) / W with s = signal / bias in place of m^2, in float64."""
    m, v, kw = global_batch_step_case("adam_signal", 4096, seed=4, world=4)
    md, vd = m.double() / kw["bias1"], v.double() / kw["bias2"]
    raw = kw["signal"].double() + (md * md - kw["signal"].double()) * kw["signal_weight"]
    sd = raw / kw["signal_bias"]
    vg = sd + (vd - sd).clamp_min(0) / 4
    own = kw["lr"] * md / (vd.sqrt() + kw["eps"])
    target, signal = own.float(), kw["signal"].clone()
    ops.global_batch_step(m, v, target, **dict(kw, signal=signal))
    torch.testing.assert_close(signal.double(), raw, rtol=1e-5, atol=1e-30)
    torch.testing.assert_close(target.double(), kw["lr"] * md / (vg.sqrt() + kw["eps"]), rtol=1e-5, atol=1e-12)
    without = own.float()
    ops.global_batch_step(m, v, without, **{k: x for k, x in kw.items() if not k.startswith("signal")})
    assert not torch.equal(without, target)  # the squared mean it keeps whole is not this step's m^2


def _cloned(kw):
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in kw.items()}


@pytest.mark.parametrize("n", [0, 1, 17, 2 * CHUNK + 1, BIG])
@pytest.mark.parametrize("kind,variant", TRACKED_FORMS, ids=[f"{k}-{v}" for k, v in TRACKED_FORMS])
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("world", [1, 3])
def test_global_batch_step_tracked_matches_reference(n, kind, variant, sign, world):
    """The target, gradshare's mean gradient and its extra state, bit for bit, edge and non-finite values too."""
    grad, change, mean, kw = tracked_step_case(kind, variant, n, seed=n + world, world=world, edge=True,
                                               nonfinite=True, maximize=sign < 0)
    target = torch.randn(n)
    expected, original, exp_mean, exp_kw = target.clone(), target.clone(), mean.clone(), _cloned(kw)
    reference.global_batch_step_tracked(grad, change, exp_mean, expected, sign=sign, **exp_kw)
    ops.global_batch_step_tracked(grad, change, mean, target, sign=sign, **kw)
    assert_bits_equal(target, expected)
    assert_bits_equal(mean, exp_mean)
    for key in ("extra", "signal"):
        if key in kw:
            assert_bits_equal(kw[key], exp_kw[key])
    if n >= 8:
        assert not torch.equal(mean[8:], tracked_step_case(kind, variant, n, seed=n + world)[2][8:])   # it moved
        if world == 1 and "momentum" not in variant:   # one rank: its batch is the global batch; only roundings
            torch.testing.assert_close(target[8:], original[8:], rtol=1e-6, atol=1e-9)
        elif world > 1:
            assert not torch.equal(target[8:], original[8:])


IN_PLACE = ([(k, v, alias) for k, v in TRACKED_FORMS if "decay" in v for alias in ("change", "after")]
            + [("rmsprop", "momentum", "change"), ("adamax", "plain", "change")])


@pytest.mark.parametrize("kind,variant,alias", IN_PLACE, ids=["-".join(c) for c in IN_PLACE])
def test_global_batch_step_tracked_in_place(kind, variant, alias):
    """The sharing core rescales its change buffer in place, local steps the parameters (``after``: read with a
    weight decay)."""
    n = 2 * CHUNK + 5
    grad, change, mean, kw = tracked_step_case(kind, variant, n, seed=3)
    kw["change"] = change
    sign = 1.0 if alias == "change" else -1.0
    target = kw[alias].clone()
    expected, exp_mean, exp_kw = target.clone(), mean.clone(), _cloned(kw)
    exp_kw[alias] = expected.clone()
    reference.global_batch_step_tracked(grad, exp_kw.pop("change"), exp_mean, expected, sign=sign, **exp_kw)
    run_kw = dict(kw, **{alias: target})
    ops.global_batch_step_tracked(grad, run_kw.pop("change"), mean, target, sign=sign, **run_kw)
    assert_bits_equal(target, expected)
    assert_bits_equal(mean, exp_mean)
    assert not torch.equal(target, kw[alias])


def test_global_batch_step_tracked_threads_agree(threads):
    out = []
    for t in (1, 2, 4):
        threads(t)
        grad, change, mean, kw = tracked_step_case("rmsprop", "centered_momentum", BIG, seed=9)
        target = torch.zeros(BIG)
        ops.global_batch_step_tracked(grad, change, mean, target, **kw)
        out.append((target, mean, kw["extra"]))
    for a, b in zip(out[0], out[1]):
        assert_bits_equal(a, b)
    for a, b in zip(out[0], out[2]):
        assert_bits_equal(a, b)


def test_global_batch_step_tracked_is_the_step_with_the_global_second_moment():
    """The rule itself for RMSprop, in float64: the rank's change lr g / (sqrt(v) + eps) plus the excess is
    lr g / (sqrt(v_global) + eps), v_global = k (s + (v_hat - s) / W), s = min(m^2, v_hat), m the mean
    gradient after this step, v_hat = v / k."""
    grad, change, mean, kw = tracked_step_case("rmsprop", "plain", 4096, seed=4, world=4)
    lr, k = 1e-2, kw["scale"]
    v = kw["second"].double()
    m = (mean.double() + (grad.double() - mean.double()) * 0.1) / kw["mean_bias"]
    s = torch.minimum(m * m, v / k)
    vg = k * (s + (v / k - s) / 4)
    own = (lr * grad.double() / (v.sqrt() + kw["eps"]))
    target = own.float()
    ops.global_batch_step_tracked(grad, target.clone(), mean, target, **kw)
    torch.testing.assert_close(target.double(), lr * grad.double() / (vg.sqrt() + kw["eps"]), rtol=1e-5, atol=1e-12)
    assert (vg < v).any()


def test_shaped_tensors_are_flattened():
    update, residual = make_state(24 * 37, 0.05)
    m1 = ops.encode(update.view(24, 37), residual.clone().view(37, 24), 1.0)
    m2 = ops.encode(update, residual.clone(), 1.0)
    assert_bits_equal(m1, m2)
    d = torch.zeros(24, 37)
    ops.decode(d, m1)
    assert d.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------
# numpy inputs
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_numpy_encode_decode_count(dtype):
    update, residual = make_state(5000, 0.05)
    u_np, r_np = update.numpy().astype(dtype), residual.numpy().copy()
    r_ref = residual.clone()
    m = ops.encode(u_np, r_np, 1.0)
    assert isinstance(m, np.ndarray) and m.dtype == np.int32
    m_ref = reference.encode(torch.from_numpy(u_np), r_ref, 1.0)
    assert_bits_equal(torch.from_numpy(m), m_ref)
    assert_bits_equal(torch.from_numpy(r_np), r_ref)  # updated in place
    assert ops.count(u_np, r_np, 0.5) == reference.count(torch.from_numpy(u_np), r_ref, 0.5)[0]
    d_np, d_ref = np.zeros(5000, np.float32), torch.zeros(5000)
    ops.decode(d_np, m)
    reference.decode(d_ref, m_ref)
    assert_bits_equal(torch.from_numpy(d_np), d_ref)
    ops.decode(d_np, [m, m_ref])  # a list mixing numpy and torch messages
    reference.decode(d_ref, [m_ref, m_ref])
    assert_bits_equal(torch.from_numpy(d_np), d_ref)


def test_numpy_average():
    rng = np.random.default_rng(0)
    bufs = [rng.standard_normal(3000).astype(np.float32) for _ in range(3)]
    expected = reference.average([torch.from_numpy(b.copy()) for b in bufs], [1.0, -2.0, 0.5])
    out = ops.average(bufs, weights=[1.0, -2.0, 0.5])
    assert isinstance(out, np.ndarray)
    assert_bits_equal(torch.from_numpy(out), expected)


def test_numpy_average_in_place_matches_reference():
    rng = np.random.default_rng(1)
    bufs = [rng.standard_normal(3000).astype(np.float32) for _ in range(3)]
    expected = reference.average([torch.from_numpy(b.copy()) for b in bufs])
    res = ops.average(bufs, out=bufs[1])
    assert res is bufs[1]
    assert_bits_equal(torch.from_numpy(bufs[1]), expected)


# ---------------------------------------------------------------------------------------------------
# properties (hypothesis)
# ---------------------------------------------------------------------------------------------------

finite32 = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)
small_states = st.integers(min_value=0, max_value=300).flatmap(
    lambda n: st.tuples(st.lists(finite32, min_size=n, max_size=n), st.lists(finite32, min_size=n, max_size=n)))
taus = st.floats(min_value=2.0**-20, max_value=1e4, allow_nan=False, width=32)


@settings(max_examples=100, deadline=None)
@given(state=small_states, tau=taus, fmt=st.sampled_from(FORMATS))
def test_property_residual_plus_decoded_is_conserved(state, tau, fmt):
    update, residual = torch.tensor(state[0], dtype=torch.float32), torch.tensor(state[1], dtype=torch.float32)
    before = residual.clone()
    msg = ops.encode(update, residual, tau, format=fmt)
    decoded = torch.zeros_like(residual)
    ops.decode(decoded, msg)
    lhs = residual.double() + decoded.double()
    rhs = before.double() + update.double()
    # two float32 roundings: u = r + g, and u - tau
    bound = 2.0**-23 * (rhs.abs() + tau) * 2
    assert bool(((lhs - rhs).abs() <= bound).all())
    # one +-tau per element per step: what stays is u - sign*tau
    u = before + update
    sent = decoded != 0
    assert bool((sent == (u.abs() >= tau)).all())


@settings(max_examples=60, deadline=None)
@given(state=small_states, tau=taus, clip=st.one_of(st.none(), st.floats(0.1, 10.0)))
def test_property_sparse_and_bitmap_decode_alike(state, tau, clip):
    update, residual = torch.tensor(state[0], dtype=torch.float32), torch.tensor(state[1], dtype=torch.float32)
    r1, r2 = residual.clone(), residual.clone()
    m1 = ops.encode(update, r1, tau, clip=clip, format="sparse")
    m2 = ops.encode(update, r2, tau, clip=clip, format="bitmap")
    assert msgfmt.parse_header(m1).format == SPARSE and msgfmt.parse_header(m2).format == BITMAP
    assert msgfmt.parse_header(m1).count == msgfmt.parse_header(m2).count
    assert_bits_equal(r1, r2)
    d1, d2 = torch.zeros_like(residual), torch.zeros_like(residual)
    ops.decode(d1, m1)
    ops.decode(d2, m2)
    assert_bits_equal(d1, d2)


# ---------------------------------------------------------------------------------------------------
# determinism across thread counts
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("density", [1e-3, 0.2])
def test_same_result_for_any_thread_count(threads, fmt, density):
    update, residual = make_state(BIG, density, seed=11)
    results = []
    for t in (1, 2, 3):
        threads(t)
        r = residual.clone()
        m = ops.encode(update, r, 1.0, format=fmt)
        c = ops.count(update, residual, 1.0)
        d = torch.zeros(BIG)
        ops.decode(d, [m, m], scale=0.5)
        a = ops.average([update, residual, r])
        results.append((m, r, c, d, a))
    for m, r, c, d, a in results[1:]:
        assert_bits_equal(m, results[0][0])
        assert_bits_equal(r, results[0][1])
        assert c == results[0][2]
        assert_bits_equal(d, results[0][3])
        assert_bits_equal(a, results[0][4])
    assert msgfmt.parse_header(results[0][0]).count > 0


# ---------------------------------------------------------------------------------------------------
# non-finite input
# ---------------------------------------------------------------------------------------------------

NONFINITE_CASES = {
    "nan_update": lambda u, r, i: u.__setitem__(i, float("nan")),
    "inf_update": lambda u, r, i: u.__setitem__(i, float("inf")),
    "neg_inf_update": lambda u, r, i: u.__setitem__(i, float("-inf")),
    "nan_residual": lambda u, r, i: r.__setitem__(i, float("nan")),
    "overflow": lambda u, r, i: (u.__setitem__(i, 3e38), r.__setitem__(i, 3e38)),
    "neg_overflow": lambda u, r, i: (u.__setitem__(i, -3e38), r.__setitem__(i, -3e38)),
}


@pytest.mark.parametrize("case", sorted(NONFINITE_CASES))
@pytest.mark.parametrize("n,where", [(1, [0]), (17, [16]), (2 * CHUNK + 9, [2 * CHUNK + 3, CHUNK + 1]),
                                     (BIG, [BIG - 1, 5 * CHUNK, 3 * CHUNK + 2])])
@pytest.mark.parametrize("fmt", FORMATS)
def test_nonfinite_raises_or_flags_and_leaves_residual(case, n, where, fmt):
    update, residual = make_state(n, 0.05, seed=n)
    for i in where:
        NONFINITE_CASES[case](update, residual, i)
    first = min(where)
    before = residual.clone()
    with pytest.raises(gradshare.NonFiniteError) as e:
        ops.encode(update, residual, 1.0, format=fmt)
    assert e.value.index == first and str(first) in str(e.value)
    assert_bits_equal(residual, before)
    marker = ops.encode(update, residual, 1.0, format=fmt, on_nonfinite="flag", clip=2.0)
    assert_bits_equal(residual, before)
    assert marker.tolist() == msgfmt.nonfinite_marker(n, 1.0, first).tolist()
    assert msgfmt.parse_header(marker).format == NONFINITE
    with pytest.raises(gradshare.NonFiniteError) as e:
        ops.count(update, residual, 1.0)
    assert e.value.index == first
    dst = torch.zeros(n)
    with pytest.raises(gradshare.MessageError, match="non-finite"):
        ops.decode(dst, marker)
    assert not dst.any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_nonfinite_half_update(dtype):
    update, residual = make_state(3 * CHUNK, 0.05, dtype=dtype)
    update[CHUNK + 7] = float("inf")
    before = residual.clone()
    with pytest.raises(gradshare.NonFiniteError) as e:
        ops.encode(update, residual, 1.0)
    assert e.value.index == CHUNK + 7
    assert_bits_equal(residual, before)


def test_large_finite_values_are_not_flagged():
    update = torch.tensor([3e38, -3e38, 1.7e38], dtype=torch.float32)
    residual = torch.tensor([0.0, 0.0, 1.7e38])
    check_encode(update, residual, 1e38)


# ---------------------------------------------------------------------------------------------------
# torch custom ops
# ---------------------------------------------------------------------------------------------------

def _opcheck(op, args):
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("choice", [-1, SPARSE, BITMAP])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_encode(choice, dtype):
    update, residual = make_state(1000, 0.05, dtype=dtype)
    _opcheck(torch.ops.gradshare.encode.default, (update, residual, 1.0, 0.0, choice))
    _opcheck(torch.ops.gradshare.encode.default, (update, residual, 0.5, 1.0, choice))


def test_opcheck_count():
    update, residual = make_state(1000, 0.05)
    _opcheck(torch.ops.gradshare.count.default, (update, residual, 1.0))
    _opcheck(torch.ops.gradshare.count.default, (update.half(), residual, 1.0))


def test_opcheck_decode():
    msgs = _messages(500, 3, seed=1)
    rows = torch.stack([torch.nn.functional.pad(m, (0, 505 - m.numel())) for m in msgs])
    _opcheck(torch.ops.gradshare.decode.default, (torch.randn(500), rows, 1.0))
    _opcheck(torch.ops.gradshare.decode.default, (torch.randn(500), rows[:1], -0.5))


def test_opcheck_average():
    bufs = [torch.randn(700) for _ in range(4)]
    _opcheck(torch.ops.gradshare.average.default, (torch.empty(700), bufs, None))
    _opcheck(torch.ops.gradshare.average.default, (torch.empty(700), bufs, [0.1, 0.2, 0.3, 0.4]))


def test_opcheck_global_batch_step():
    m, v, kw = global_batch_step_case("change_decay", 700, seed=2)
    _opcheck(torch.ops.gradshare.global_batch_step.default,
             (m, v, torch.randn(700), kw["change"], kw["after"], None, kw["bias1"], kw["bias2"], 2.0, kw["eps"], 0.0,
              kw["decay"], -1.0, 0.0, 1.0))
    m, v, kw = global_batch_step_case("adam_signal", 700, seed=2)
    _opcheck(torch.ops.gradshare.global_batch_step.default,
             (m, v, torch.randn(700), None, None, kw["signal"], kw["bias1"], kw["bias2"], 2.0, kw["eps"], kw["lr"],
              0.0, 1.0, kw["signal_weight"], kw["signal_bias"]))


def test_opcheck_global_batch_step_tracked():
    from gradshare.ops import TRACKED_SCALARS
    for kind, variant in (("rmsprop", "centered_momentum"), ("adafactor", "decay"), ("adagrad", "plain"),
                          ("adamax", "decay_signal")):
        grad, change, mean, kw = tracked_step_case(kind, variant, 700, seed=2)
        scalars = dict(world=2.0, inv_world=0.5, grad_sign=1.0, weight_decay=kw.get("weight_decay", 0.0),
                       decay=kw.get("decay", 0.0), mean_weight=0.1, mean_bias=kw["mean_bias"],
                       offset=kw.get("offset", 0.0), scale=kw.get("scale", 1.0), count=kw.get("count", 1.0),
                       eps=kw.get("eps", 0.0), momentum=kw.get("momentum", 0.0), lr=kw.get("lr", 0.0),
                       square_weight=kw.get("square_weight", 0.0), square_bias=kw.get("square_bias", 1.0), sign=1.0,
                       signal_weight=kw.get("signal_weight", 0.0), signal_bias=kw.get("signal_bias", 1.0))
        _opcheck(torch.ops.gradshare.global_batch_step_tracked.default,
                 (grad, change, kw.get("after"), kw.get("second"), kw.get("grad_avg"), mean, kw.get("extra"),
                  kw.get("signal"), torch.randn(700), ["rmsprop", "adagrad", "adadelta", "adamax", "adafactor"].index(kind),
                  [scalars[n] for n in TRACKED_SCALARS]))


def _train_step(update, residual, dst, params):
    g = update * 2.0
    c = ops.count(g, residual, 0.5)
    msg = ops.encode(g, residual, 0.5, format="sparse")
    ops.decode(dst, msg, scale=0.5)
    avg = ops.average([dst, params], weights=[0.25, 0.75])
    return msg, avg + 1.0, c


def test_torch_compile_public_ops_match_eager():
    torch._dynamo.reset()
    update, residual = make_state(3000, 0.05, seed=5)
    params = torch.randn(3000)
    r1, r2, d1, d2 = residual.clone(), residual.clone(), torch.zeros(3000), torch.zeros(3000)
    eager = _train_step(update, r1, d1, params)
    compiled = torch.compile(_train_step, backend="aot_eager")(update, r2, d2, params)
    assert_bits_equal(compiled[0], eager[0])
    assert_bits_equal(compiled[1], eager[1])
    assert compiled[2] == eager[2]
    assert_bits_equal(r2, r1)
    assert_bits_equal(d2, d1)


def _fused_graph(update, residual, dst, rows, params):
    cnt = torch.ops.gradshare.count(update * 2.0, residual, 0.5)
    torch.ops.gradshare.decode(dst, rows, 0.5)
    out = torch.empty_like(dst)
    torch.ops.gradshare.average(out, [dst, params * 3.0], None)
    return out + 1.0, cnt


def test_torch_compile_inductor_fullgraph_custom_ops():
    torch._dynamo.reset()
    update, residual = make_state(2000, 0.05, seed=6)
    rows = torch.stack(_messages(2000, 1, seed=2) * 2)
    params = torch.randn(2000)
    d1, d2 = torch.zeros(2000), torch.zeros(2000)
    eager = _fused_graph(update, residual, d1, rows, params)
    compiled = torch.compile(_fused_graph, fullgraph=True)(update, residual, d2, rows, params)
    assert_bits_equal(d2, d1)
    assert_bits_equal(compiled[0], eager[0])
    assert compiled[1].tolist() == eager[1].tolist()


# ---------------------------------------------------------------------------------------------------
# kept=: what is not sent goes to another buffer and the residual is only read (gradshare.sharing)
# ---------------------------------------------------------------------------------------------------

def _encoders():
    return {"strom_sparse": lambda u, r, **kw: ops.encode(u, r, 1.0, format="sparse", **kw),
            "strom_bitmap_clip": lambda u, r, **kw: ops.encode(u, r, 1.0, format="bitmap", clip=0.5, **kw),
            "topk_bf16": lambda u, r, **kw: ops.encode_topk(u, r, 41, chunk=4096, **kw),
            "topk_int8": lambda u, r, **kw: ops.encode_topk(u, r, 82, chunk=4096, values="int8", **kw),
            "ternary": lambda u, r, **kw: ops.encode_ternary(u, r, 0.5, chunk=4096, **kw)}


@pytest.mark.parametrize("kind", sorted(_encoders()))
@pytest.mark.parametrize("n", [0, 1, 17, 4097, 2 * CHUNK + 9, BIG])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kept_gets_what_in_place_keeps_and_the_residual_is_only_read(kind, n, dtype):
    enc = _encoders()[kind]
    update, residual = make_state(n, 0.05, dtype=dtype, seed=n)
    in_place = residual.clone()
    m_in_place = enc(update, in_place)
    before, kept = residual.clone(), torch.full((n,), 7.0)
    m_kept = enc(update, residual, kept=kept)
    assert_bits_equal(m_kept, m_in_place)
    assert_bits_equal(kept, in_place)
    assert_bits_equal(residual, before)
    again = residual.clone()                                   # kept=residual is the in-place call
    assert_bits_equal(enc(update, again, kept=again), m_in_place)
    assert_bits_equal(again, in_place)


@pytest.mark.parametrize("kind", sorted(_encoders()))
def test_kept_nonfinite_leaves_the_residual(kind):
    enc = _encoders()[kind]
    update, residual = make_state(3 * 4096, 0.05, seed=3)
    update[4100] = float("nan")
    before = residual.clone()
    try:
        msg = enc(update, residual, kept=torch.zeros(3 * 4096))
        assert msgfmt.parse_header(msg).format == NONFINITE
    except gradshare.NonFiniteError:
        pass
    assert_bits_equal(residual, before)


def test_kept_refuses_overlap_size_and_dtype():
    update, residual = make_state(64, 0.05)
    both = torch.zeros(128)
    with pytest.raises(ValueError, match="kept: shares memory with update"):
        ops.encode_topk(update, residual, 4, chunk=64, kept=update)
    with pytest.raises(ValueError, match="kept: overlaps residual"):
        ops.encode(update, both[:64], 1.0, kept=both[32:96])
    with pytest.raises(ValueError, match="kept: 10 elements"):
        ops.encode_ternary(update, residual, 0.5, chunk=64, kept=torch.zeros(10))
    with pytest.raises(TypeError, match="kept: dtype float16"):
        ops.encode(update, residual, 1.0, kept=torch.zeros(64, dtype=torch.float16))
    before = residual.clone()
    with pytest.raises(ValueError):
        ops.encode(update, residual, 1.0, kept=update)
    assert_bits_equal(residual, before)


def test_kept_under_a_torch_function_mode_takes_the_registered_op():
    # Tracing sees only the in-place ops: kept takes a copy of the residual and the op runs on it.
    update, residual = make_state(5000, 0.05)
    in_place = residual.clone()
    m_in_place = ops.encode_topk(update, in_place, 41, chunk=4096)
    class Passthrough(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    kept, before = torch.zeros(5000), residual.clone()
    with Passthrough():
        m = ops.encode_topk(update, residual, 41, chunk=4096, kept=kept)
    assert_bits_equal(m, m_in_place)
    assert_bits_equal(kept, in_place)
    assert_bits_equal(residual, before)


def test_global_batch_step_tracked_without_the_native_library_matches(monkeypatch):
    """The op's fallback (no native library: gradshare.reference) passes its scalars on unchanged."""
    from gradshare import _native
    grad, change, mean, kw = tracked_step_case("rmsprop", "centered_momentum", 999, seed=5, world=3, maximize=True)
    target, exp_mean, exp_kw = torch.randn(999), mean.clone(), _cloned(kw)
    expected = target.clone()
    ops.global_batch_step_tracked(grad, change, exp_mean, expected, sign=-1.0, **exp_kw)
    monkeypatch.setattr(_native, "available", lambda: False)
    ops.global_batch_step_tracked(grad, change, mean, target, sign=-1.0, **kw)
    assert_bits_equal(target, expected)
    assert_bits_equal(mean, exp_mean)
    assert_bits_equal(kw["extra"], exp_kw["extra"])
