"""The CUDA kernels against the CPU kernels, bit for bit, through gradshare.ops with CUDA tensors:
encode (every format, dtype, clipping, density and size around the kernels' tile and word boundaries),
count, decode (one and several messages, both formats, scales), averaging (mean, weighted, in place), the
global batch's step of Adam-family optimizers (every form, in place),
non-finite handling, malformed-message rejection (same error text as the CPU, dst untouched), the fused
momentum of every encoder and launching on the caller's current stream. Runs only where a GPU and a CUDA build of gradshare exist."""
import numpy as np
import pytest
import torch

import gradshare
from gradshare import message as msgfmt
from gradshare import ops
from gradshare.message import BITMAP, HEADER_WORDS, MAGIC_VERSION, NONFINITE, SPARSE
from op_inputs import TRACKED_FORMS, assert_bits_equal, global_batch_step_case, make_state, tracked_step_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and gradshare.build_info()["cuda"]),
                       reason="needs a CUDA device and gradshare built with its CUDA kernels"),
]

TILE = 256 * 16  # csrc/cuda/encode.cu: kThreads * kItems elements per block of the count/sparse passes
SIZES = [0, 1, 2, 15, 16, 17, 31, 32, 33, 255, 256, 257, 1000, TILE - 1, TILE, TILE + 1, 2 * TILE + 17,
         2**15 + 3, 2**16 + 17]
BIG = 2**20 + 7
FORMATS = ["auto", "sparse", "bitmap"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEV = "cuda"


def gpu(t: torch.Tensor) -> torch.Tensor:
    """A copy on the GPU (never an alias of the CPU tensor it came from)."""
    return t.to(DEV, copy=True)


def encode_both(update, residual, tau, clip=None, fmt="auto", on_nonfinite="raise"):
    """Encodes the same state on the CPU and on the GPU; asserts message and residual agree bit for bit."""
    r_cpu, r_gpu = residual.clone(), gpu(residual)
    m_cpu = ops.encode(update, r_cpu, tau, clip=clip, format=fmt, on_nonfinite=on_nonfinite)
    m_gpu = ops.encode(gpu(update), r_gpu, tau, clip=clip, format=fmt, on_nonfinite=on_nonfinite)
    assert m_gpu.device.type == r_gpu.device.type == DEV
    assert_bits_equal(m_gpu, m_cpu)
    assert_bits_equal(r_gpu, r_cpu)
    return m_cpu, r_cpu


# ---------------------------------------------------------------------------------------------------
# encode / count
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("density", [0.0, 0.001, 0.05, 0.5, 1.0])
def test_encode_matches_cpu_sizes(n, fmt, density):
    update, residual = make_state(n, density, seed=n + 1)
    msg, _ = encode_both(update, residual, 1.0, fmt=fmt)
    info = msgfmt.parse_header(msg)
    assert info.n == n and msg.numel() == info.words


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tau", [1e-3, 0.37, 1.0, 300.0])
@pytest.mark.parametrize("clip", [None, 0.5, 3.0])
@pytest.mark.parametrize("fmt", FORMATS)
def test_encode_matches_cpu_dtypes_taus_clip(dtype, tau, clip, fmt):
    update, residual = make_state(3 * TILE + 77, 0.03, dtype=dtype, seed=7, tau=tau)
    encode_both(update, residual, tau, clip=clip, fmt=fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_matches_cpu_large(fmt, dtype):
    update, residual = make_state(BIG, 0.002, dtype=dtype, seed=3)
    encode_both(update, residual, 1.0, clip=4.0, fmt=fmt)


def test_encode_repeated_steps_stay_identical():
    """Residuals carried over several steps (the training loop) stay bit-identical."""
    n = 5 * TILE + 3
    r_cpu, r_gpu = torch.zeros(n), torch.zeros(n, device=DEV)
    for step in range(6):
        update, _ = make_state(n, 0.01, seed=100 + step, tau=0.1)
        m_cpu = ops.encode(update, r_cpu, 0.1, clip=5.0)
        m_gpu = ops.encode(gpu(update), r_gpu, 0.1, clip=5.0)
        assert_bits_equal(m_gpu, m_cpu)
        assert_bits_equal(r_gpu, r_cpu)


def test_encode_exact_threshold_signed_zero_and_subnormals():
    tau = 0.5
    residual = torch.tensor([0.25, -0.25, 0.0, -0.0, 0.5, -0.5, 1e-45, -1e-45, 0.0, 0.0, 1.0, -1.0, 0.0, 0.0, 0.0,
                             0.0, 0.0])
    update = torch.tensor([0.25, -0.25, 0.5, -0.5, 0.0, -0.0, 0.0, 0.0, 1e-40, -1e-40, -0.5, 0.5, 0.4999999,
                           -0.4999999, 0.5000001, -0.5000001, -0.0])
    for fmt in FORMATS:
        encode_both(update, residual, tau, fmt=fmt)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_encode_converts_every_half_value_like_the_cpu(dtype):
    """All 65536 bit patterns (NaN/Inf excluded): the device half/bf16 -> float conversion is the CPU's."""
    pattern = torch.arange(-32768, 32768, dtype=torch.int16).view(dtype)
    update = pattern[torch.isfinite(pattern.float())].contiguous()
    residual = torch.zeros(update.numel())
    for tau in (1e-7, 1.0):
        encode_both(update, residual, tau, fmt="sparse")
        encode_both(update, residual, tau, fmt="bitmap")


@pytest.mark.parametrize("n", [0, 1, 17, TILE + 1, 2**16 + 17])
@pytest.mark.parametrize("dtype", DTYPES)
def test_count_matches_cpu(n, dtype):
    for density in (0.0, 0.01, 0.3):
        update, residual = make_state(n, density, dtype=dtype, seed=n + 5)
        c_cpu = ops.count(update, residual, 1.0)
        c_gpu = ops.count(gpu(update), gpu(residual), 1.0)
        assert c_gpu == c_cpu


@pytest.mark.parametrize("n", [1, 100, TILE + 5, 2**16 + 17])
@pytest.mark.parametrize("where", ["first", "middle", "last", "two"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_reports_the_first_index_and_writes_nothing(n, where, value):
    update, residual = make_state(n, 0.05, seed=11)
    idx = {"first": [0], "middle": [n // 2], "last": [n - 1], "two": [n - 1, n // 3]}[where]
    for i in idx:
        update[i] = value
    first = min(idx)
    with pytest.raises(gradshare.NonFiniteError) as cpu_err:
        ops.count(update, residual, 1.0)
    with pytest.raises(gradshare.NonFiniteError) as gpu_err:
        ops.count(gpu(update), gpu(residual), 1.0)
    assert gpu_err.value.index == cpu_err.value.index == first
    for fmt in FORMATS:
        r_gpu = gpu(residual)
        with pytest.raises(gradshare.NonFiniteError) as e:
            ops.encode(gpu(update), r_gpu, 1.0, format=fmt)
        assert e.value.index == first
        assert_bits_equal(r_gpu, residual)
        marker, _ = encode_both(update, residual, 1.0, fmt=fmt, on_nonfinite="flag")
        assert int(marker[1]) == NONFINITE and int(marker[3]) == first


def test_encode_overflowing_sum_is_nonfinite():
    """Finite residual + finite bf16 update that overflows to inf is flagged at the same index."""
    update = torch.tensor([1.0, 3.3e38, 3.3e38], dtype=torch.bfloat16)
    residual = torch.tensor([0.0, 3.4e38, -3.4e38])
    marker, _ = encode_both(update, residual, 1.0, on_nonfinite="flag")
    assert int(marker[1]) == NONFINITE and int(marker[3]) == 1


# ---------------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------------

def random_messages(n, k, seed, fmts=("sparse", "bitmap"), density=0.02):
    msgs = []
    for j in range(k):
        update, residual = make_state(n, density * (j + 1), seed=seed + j, tau=0.25 * (j + 1))
        msgs.append(ops.encode(update, residual, 0.25 * (j + 1), format=fmts[j % len(fmts)]))
    return msgs


def decode_both(n, messages, scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    d_cpu = torch.randn(n, generator=g)
    d_gpu = gpu(d_cpu)
    ops.decode(d_cpu, messages, scale=scale)
    on_gpu = ([gpu(m) for m in messages] if isinstance(messages, (list, tuple)) else gpu(messages))
    ops.decode(d_gpu, on_gpu, scale=scale)
    assert_bits_equal(d_gpu, d_cpu)
    return d_cpu


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 255, 257, 1000, TILE + 3, 2**16 + 17, BIG])
@pytest.mark.parametrize("scale", [1.0, -0.5, 1.0 / 3.0])
def test_decode_matches_cpu(n, scale):
    msgs = random_messages(n, 4, seed=n)
    decode_both(n, msgs, scale)
    decode_both(n, msgs[0], scale)  # a single 1-D message


def test_decode_padded_rows_and_auto_formats():
    n = 3 * TILE + 5
    msgs = random_messages(n, 6, seed=21, fmts=("auto",), density=0.05)
    assert {int(m[1]) for m in msgs} == {SPARSE, BITMAP}
    width = max(m.numel() for m in msgs) + 7
    rows = torch.zeros(len(msgs), width, dtype=torch.int32)
    for i, m in enumerate(msgs):
        rows[i, :m.numel()] = m
        rows[i, m.numel():] = 12345  # words past a message's end are ignored
    decode_both(n, rows, 0.75)


def test_decode_same_element_from_many_messages_in_order():
    """Several messages hitting the same elements are applied in message order (float rounding order)."""
    n = 64
    msgs = []
    for j in range(9):
        tau = [1e-8, 1.0, 3e-8, 1e7, 7e-9][j % 5]
        msgs.append(torch.tensor(msgfmt.header(SPARSE, n, 3, tau) + [1, -2, 64], dtype=torch.int32))
    decode_both(n, msgs, 1.0)


def test_decode_gpu_encoded_messages_roundtrip():
    n = 2 * TILE + 9
    update, residual = make_state(n, 0.02, seed=4)
    before = gpu(residual + update.float())
    for fmt in ("sparse", "bitmap"):
        r = gpu(residual)
        msg = ops.encode(gpu(update), r, 1.0, format=fmt)
        decoded = torch.zeros(n, device=DEV)
        ops.decode(decoded, msg)
        # Each element moved by exactly 0 or +-tau: kept + decoded reproduces u (tau = 1 is exact here).
        torch.testing.assert_close(r + decoded, before, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# malformed messages: same error as the CPU, nothing written
# ---------------------------------------------------------------------------------------------------

N = 50


def good_sparse():
    return torch.tensor(msgfmt.header(SPARSE, N, 4, 0.5) + [1, -7, 20, -50], dtype=torch.int32)


def good_bitmap():
    words = [0] * msgfmt.bitmap_words(N)
    words[0] = 0b11 | (0b10 << 16)  # +e0, -e1
    words[3] = 0b10                 # e49
    return torch.tensor(msgfmt.header(BITMAP, N, 3, 0.5) + words, dtype=torch.int32)


def mutate(msg, word, value):
    m = msg.clone()
    m[word] = value
    return m


BAD = {
    "short": lambda: good_sparse()[:3],
    "magic": lambda: mutate(good_sparse(), 0, MAGIC_VERSION + 1),
    "marker": lambda: msgfmt.nonfinite_marker(N, 0.5, 3),
    "format": lambda: mutate(good_sparse(), 1, 7),
    "n": lambda: mutate(good_sparse(), 2, N + 1),
    "n_negative": lambda: mutate(good_sparse(), 2, -1),
    "count_negative": lambda: mutate(good_sparse(), 3, -1),
    "count_past_n": lambda: mutate(good_sparse(), 3, N + 1),
    "count_past_row": lambda: mutate(good_sparse(), 3, 5),
    "tau_zero": lambda: mutate(good_sparse(), 4, 0),
    "tau_negative": lambda: mutate(good_sparse(), 4, msgfmt.float_bits(-0.5)),
    "tau_nan": lambda: mutate(good_sparse(), 4, 0x7FC00000),
    "tau_inf": lambda: mutate(good_sparse(), 4, 0x7F800000),
    "entry_zero": lambda: mutate(good_sparse(), 5, 0),
    "entry_past_n": lambda: mutate(good_sparse(), 8, N + 1),
    "entry_negative_past_n": lambda: mutate(good_sparse(), 8, -(N + 1)),
    "entry_int_min": lambda: mutate(good_sparse(), 6, -2**31),
    "entry_int_max": lambda: mutate(good_sparse(), 8, 2**31 - 1),
    "entry_repeated": lambda: mutate(good_sparse(), 7, -7),
    "entry_descending": lambda: mutate(good_sparse(), 6, 30),
    "bitmap_sign_without_present": lambda: mutate(good_bitmap(), HEADER_WORDS + 1, 1 << 20),
    "bitmap_bit_past_n": lambda: mutate(good_bitmap(), HEADER_WORDS + 3, 0b110),
    "bitmap_sign_past_n": lambda: mutate(good_bitmap(), HEADER_WORDS + 3, 0b10 | (1 << 30)),
    "bitmap_count_low": lambda: mutate(good_bitmap(), 3, 2),
    "bitmap_count_high": lambda: mutate(good_bitmap(), 3, 4),
    "bitmap_short_row": lambda: good_bitmap()[:-1],
}


def cpu_error(messages) -> str:
    dst = torch.zeros(N)
    with pytest.raises(gradshare.MessageError) as e:
        ops.decode(dst, messages)
    assert torch.count_nonzero(dst) == 0
    return str(e.value)


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("position", [0, 2])
def test_bad_message_rejected_like_cpu_and_dst_untouched(case, position):
    msgs = [good_sparse(), good_bitmap(), good_sparse()]
    msgs.insert(position, BAD[case]())
    expected = cpu_error(msgs)
    assert expected.startswith(f"message {position}:")
    dst = torch.randn(N, device=DEV)
    before = dst.clone()
    with pytest.raises(gradshare.MessageError) as e:
        ops.decode(dst, [gpu(m) for m in msgs])
    assert str(e.value) == expected
    assert_bits_equal(dst, before)


def test_first_faulty_message_is_reported_whatever_its_fault():
    """A payload fault in message 0 is reported before a header fault in message 1 (as on the CPU)."""
    msgs = [BAD["entry_past_n"](), BAD["magic"]()]
    expected = cpu_error(msgs)
    assert expected.startswith("message 0:")
    dst = torch.zeros(N, device=DEV)
    with pytest.raises(gradshare.MessageError) as e:
        ops.decode(dst, [gpu(m) for m in msgs])
    assert str(e.value) == expected


def test_random_mutations_never_write_out_of_bounds():
    """Mutated messages decode exactly as on the CPU or raise the same error; dst's guard words stay."""
    g = np.random.default_rng(5)
    base = [good_sparse(), good_bitmap()]
    guard = 64
    for trial in range(400):
        msg = base[trial % 2].clone()
        for _ in range(int(g.integers(1, 4))):
            w = int(g.integers(0, msg.numel()))
            msg[w] = int(g.choice([0, 1, -1, N, N + 1, -(N + 1), 2**31 - 1, -2**31, int(g.integers(-2**31, 2**31))]))
        d_cpu = torch.zeros(N)
        padded = torch.full((N + 2 * guard,), 7.0, device=DEV)
        d_gpu = padded[guard:guard + N]
        try:
            ops.decode(d_cpu, msg)
        except gradshare.MessageError as e:
            with pytest.raises(gradshare.MessageError) as ge:
                ops.decode(d_gpu, gpu(msg))
            assert str(ge.value) == str(e)
            assert bool((d_gpu == 7.0).all())
        else:
            d_gpu.zero_()
            ops.decode(d_gpu, gpu(msg))
            assert_bits_equal(d_gpu, d_cpu)
        assert bool((padded[:guard] == 7.0).all()) and bool((padded[guard + N:] == 7.0).all())


# ---------------------------------------------------------------------------------------------------
# average
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 255, 257, TILE + 3, BIG])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 128])
@pytest.mark.parametrize("weighted", [False, True])
def test_average_matches_cpu(n, k, weighted):
    if n == BIG and k == 128:
        n = 2**16 + 1  # keep memory modest
    g = torch.Generator().manual_seed(n * 131 + k)
    bufs = [torch.randn(n, generator=g) * (j + 1) for j in range(k)]
    weights = (torch.rand(k, generator=g) * 2 - 0.5).tolist() if weighted else None
    out_cpu = ops.average(bufs, weights=weights)
    out_gpu = ops.average([gpu(b) for b in bufs], weights=weights)
    assert out_gpu.device.type == DEV
    assert_bits_equal(out_gpu, out_cpu)


@pytest.mark.parametrize("alias", [0, 2])
@pytest.mark.parametrize("weighted", [False, True])
def test_average_in_place_matches_cpu(alias, weighted):
    n, k = 2 * TILE + 1, 3
    g = torch.Generator().manual_seed(alias)
    bufs = [torch.randn(n, generator=g) for _ in range(k)]
    weights = [0.2, 0.3, 0.5] if weighted else None
    expected = ops.average(bufs, weights=weights)
    on_gpu = [gpu(b) for b in bufs]
    ops.average(on_gpu, weights=weights, out=on_gpu[alias])
    assert_bits_equal(on_gpu[alias], expected)


# ---------------------------------------------------------------------------------------------------
# global_batch_step (gradshare.second_moment's rule)
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 255, 257, TILE + 3, BIG])
@pytest.mark.parametrize("form", ["adam", "change", "change_decay", "adam_signal", "change_decay_signal"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("world", [2, 7])
@pytest.mark.parametrize("noise", [0.0, 0.1, 0.6])          # 0.6 > 1/W: the divisor is float32's largest
def test_global_batch_step_matches_cpu(n, form, sign, world, noise):
    m, v, kw = global_batch_step_case(form, n, seed=n + world, world=world, edge=True)
    target = torch.randn(n)
    on_gpu = gpu(target)
    gkw = {k: (gpu(x) if torch.is_tensor(x) else x) for k, x in kw.items()}   # (copies: the op writes signal)
    ops.global_batch_step(m, v, target, sign=sign, noise=noise, **kw)
    ops.global_batch_step(gpu(m), gpu(v), on_gpu, sign=sign, noise=noise, **gkw)
    assert_bits_equal(on_gpu, target)
    if "signal" in kw:
        assert_bits_equal(gkw["signal"], kw["signal"])


def test_global_batch_steps_match_cpu():
    """Several parameters' rescaling in one call (the sharing core's), on the GPU as on the CPU."""
    steps, on_gpu = [], []
    for i, (form, n) in enumerate([("adam", 17), ("change_decay", TILE + 3), ("adam_signal", 0), ("change", 2**16 + 1)]):
        m, v, kw = global_batch_step_case(form, n, seed=60 + i, edge=True)
        t = torch.randn(n)
        row = (m, v, t, kw.get("change"), kw.get("after"), kw.get("signal"), kw["bias1"], kw["bias2"], kw["world"],
               kw["eps"], kw.get("lr", 0.0), kw.get("decay", 0.0), 1.0 if i % 2 else -1.0,
               kw.get("signal_weight", 0.0), kw.get("signal_bias", 1.0))
        steps.append(row)
        on_gpu.append(tuple(gpu(x) if torch.is_tensor(x) else x for x in row))
    ops.global_batch_steps(steps)
    ops.global_batch_steps(on_gpu)
    for c, g in zip(steps, on_gpu):
        assert_bits_equal(g[2], c[2])
        if c[5] is not None:
            assert_bits_equal(g[5], c[5])


@pytest.mark.parametrize("scale", [0.5, 1.0 / 3.0, 2.0])
def test_scale_into_matches_cpu(scale):
    """The all-reduced sum scaled into the gradients (torch's multi-tensor kernels on the GPU, or the reference
    for a scale above 1) writes the CPU's bits and flags what the CPU flags."""
    g = torch.Generator().manual_seed(8)
    srcs = [torch.randn(n, generator=g) for n in (17, 0, TILE + 3, 2**16 + 1)]
    srcs[0][:3] = torch.tensor([-0.0, 1e-40, torch.finfo(torch.float32).max])
    for bad_at in (None, (2, 5)):
        src = [x.clone() for x in srcs]
        if bad_at is not None:
            src[bad_at[0]][bad_at[1]] = float("nan")
        cpu_d, gpu_d = [torch.zeros_like(x) for x in src], [gpu(torch.zeros_like(x)) for x in src]
        want = ops.scale_into(cpu_d, src, scale)
        got = ops.scale_into(gpu_d, [gpu(x) for x in src], scale)
        assert got.device.type == "cuda" and got.tolist() == want.tolist()
        for a, b in zip(gpu_d, cpu_d):
            assert_bits_equal(a, b)


@pytest.mark.parametrize("alias", ["change", "after"])
def test_global_batch_step_in_place_matches_cpu(alias):
    m, v, kw = global_batch_step_case("change_decay", 2 * TILE + 1, seed=3, edge=True)
    sign = 1.0 if alias == "change" else -1.0
    target = kw[alias].clone()
    ops.global_batch_step(m, v, target, sign=sign, **dict(kw, **{alias: target}))
    on_gpu = gpu(kw[alias])
    gkw = {k: (gpu(x) if torch.is_tensor(x) else x) for k, x in kw.items()}
    ops.global_batch_step(gpu(m), gpu(v), on_gpu, sign=sign, **dict(gkw, **{alias: on_gpu}))
    assert_bits_equal(on_gpu, target)


@pytest.mark.parametrize("n", [0, 1, 257, TILE + 3, BIG])
@pytest.mark.parametrize("kind,variant", TRACKED_FORMS, ids=[f"{k}-{v}" for k, v in TRACKED_FORMS])
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("noise", [0.0, 0.08, 0.5])         # 0.5 > 1/W: the divisor is float32's largest
def test_global_batch_step_tracked_matches_cpu(n, kind, variant, sign, noise):
    """Target, mean gradient and extra state on the GPU, bit for bit as on the CPU (edge values too)."""
    grad, change, mean, kw = tracked_step_case(kind, variant, n, seed=n + 3, world=3, edge=True,
                                               maximize=sign < 0)
    kw["noise"] = noise
    target = torch.randn(n)
    on_gpu = {"target": gpu(target), "mean": gpu(mean)}
    gkw = {k: (gpu(x) if torch.is_tensor(x) else x) for k, x in kw.items()}
    ops.global_batch_step_tracked(gpu(grad), gpu(change), on_gpu["mean"], on_gpu["target"], sign=sign, **gkw)
    ops.global_batch_step_tracked(grad, change, mean, target, sign=sign, **kw)
    assert_bits_equal(on_gpu["target"], target)
    assert_bits_equal(on_gpu["mean"], mean)
    for key in ("extra", "signal"):
        if key in kw:
            assert_bits_equal(gkw[key], kw[key])


@pytest.mark.parametrize("alias", ["change", "after"])
def test_global_batch_step_tracked_in_place_matches_cpu(alias):
    grad, change, mean, kw = tracked_step_case("adamax", "decay", 2 * TILE + 1, seed=3, edge=True)
    kw["change"] = change
    sign = 1.0 if alias == "change" else -1.0
    gkw = {k: (gpu(x) if torch.is_tensor(x) else x) for k, x in kw.items()}
    g_mean = gpu(mean)
    on_gpu = gkw[alias]
    run = dict(gkw)
    ops.global_batch_step_tracked(gpu(grad), run.pop("change"), g_mean, on_gpu, sign=sign, **run)
    target = kw[alias]
    run = dict(kw)
    ops.global_batch_step_tracked(grad, run.pop("change"), mean, target, sign=sign, **run)
    assert_bits_equal(on_gpu, target)
    assert_bits_equal(g_mean, mean)


def test_average_too_many_buffers_on_gpu_raises():
    bufs = [torch.ones(4, device=DEV) for _ in range(129)]
    with pytest.raises(ValueError, match="at most 128"):
        ops.average(bufs)


# ---------------------------------------------------------------------------------------------------
# streams
# ---------------------------------------------------------------------------------------------------

def test_ops_run_on_the_current_stream():
    """Inputs written on a side stream behind a long device sleep are seen by every op issued on that
    stream: the kernels are ordered after them (a launch on another stream would read stale data)."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep not available")
    n = 2 * TILE + 7
    update, residual = make_state(n, 0.05, seed=9)
    m_cpu_res = residual.clone()
    m_cpu = ops.encode(update, m_cpu_res, 1.0)
    bufs = [torch.randn(n) for _ in range(3)]
    avg_cpu = ops.average(bufs)
    d_cpu = torch.zeros(n)
    ops.decode(d_cpu, m_cpu)

    side = torch.cuda.Stream()
    src_u, src_r = gpu(update), gpu(residual)
    src_b = [gpu(b) for b in bufs]
    msg_dev = gpu(m_cpu)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        u = torch.zeros(n, device=DEV)
        r = torch.zeros(n, device=DEV)
        b = [torch.zeros(n, device=DEV) for _ in range(3)]
        m = torch.zeros_like(msg_dev)
        torch.cuda._sleep(200_000_000)  # keeps the side stream busy for a while
        u.copy_(src_u)
        r.copy_(src_r)
        for x, y in zip(b, src_b):
            x.copy_(y)
        m.copy_(msg_dev)
        avg = ops.average(b)
        d = torch.zeros(n, device=DEV)
        ops.decode(d, m)
        msg = ops.encode(u, r, 1.0)
        c = ops.count(u, torch.zeros(n, device=DEV), 1.0)
    side.synchronize()
    assert_bits_equal(avg, avg_cpu)
    assert_bits_equal(d, d_cpu)
    assert_bits_equal(msg, m_cpu)
    assert_bits_equal(r, m_cpu_res)
    assert c == ops.count(update, torch.zeros(n), 1.0)


def test_native_cuda_entry_points_refuse_unreachable_host_memory():
    """A host pointer handed to a CUDA kernel raises instead of faulting the device. (On systems whose
    GPU can address pageable host memory, HMM/ATS, the call is allowed and must compute correctly.)"""
    from gradshare import _native
    host = torch.arange(64, dtype=torch.float32)
    dev = torch.zeros(64, device=DEV)
    stream = torch.cuda.current_stream().cuda_stream
    try:
        _native._C.average(dev.data_ptr(), [host.data_ptr()], [], 64, True, stream)
    except ValueError as e:
        assert "not CUDA memory" in str(e)
        assert torch.count_nonzero(dev) == 0
    else:
        torch.cuda.synchronize()
        assert_bits_equal(dev, host)


# ---------------------------------------------------------------------------------------------------
# top-k and ternary (csrc/cuda/chunked.cu against csrc/cpu/chunked.cpp)
# ---------------------------------------------------------------------------------------------------

TOPK_VALUES = {"topk": "bf16", "topk8": "int8", "topk_sign": "sign"}


def chunked_state(n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    update = (torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4).to(dtype)
    residual = torch.randn(n, generator=g) * 0.01
    if n > 8:   # ties of magnitude, exact zeros, -0.0
        update[3], residual[3] = update[2], residual[2]
        update[5], residual[5] = -update[2], -residual[2]
        update[6], residual[6], update[7], residual[7] = 0.0, 0.0, -0.0, -0.0
    return update, residual


def chunked_both(kind, update, residual, param, chunk):
    if kind == "ternary":
        enc = ops.encode_ternary
    else:
        def enc(u, r, k, chunk):
            return ops.encode_topk(u, r, k, chunk=chunk, values=TOPK_VALUES[kind])
    r_cpu, r_gpu = residual.clone(), gpu(residual)
    m_cpu, m_gpu = enc(update, r_cpu, param, chunk=chunk), enc(gpu(update), r_gpu, param, chunk=chunk)
    assert m_gpu.device.type == r_gpu.device.type == DEV
    assert_bits_equal(m_gpu, m_cpu)
    assert_bits_equal(r_gpu, r_cpu)
    return m_cpu


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 255, 257, 4095, 4096, 4097, 3 * 4096 + 17, 2**20 + 7])
@pytest.mark.parametrize("chunk,k", [(16, 1), (64, 64), (4096, 41), (4096, 1024), (65536, 655)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["topk", "topk8", "topk_sign"])
def test_topk_matches_cpu(n, chunk, k, dtype, kind):
    chunked_both(kind, *chunked_state(n, dtype, seed=n), k, chunk)


@pytest.mark.parametrize("n", [1, 4097, 200_003, 2**20 + 7])
@pytest.mark.parametrize("chunk,density", [(70_001, 0.02), (2**31 - 1, 0.0001), (2**31 - 1, 0.02), (2**31 - 1, 0.5)])
def test_topk_signs_over_chunks_longer_than_16_bits_match_cpu(n, chunk, density):
    # TopK(chunk=None, values="sign"): one chunk, one block, the whole buffer (the pairs hold at most n entries)
    chunked_both("topk_sign", *chunked_state(n, torch.float32, seed=n), round(density * chunk), chunk)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 32, 33, 255, 4095, 4096, 4097, 3 * 4096 + 17, 2**20 + 7])
@pytest.mark.parametrize("chunk", [16, 48, 528, 4096, 65536])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ternary_matches_cpu(n, chunk, fraction, dtype):
    chunked_both("ternary", *chunked_state(n, dtype, seed=n), fraction, chunk)


@pytest.mark.parametrize("n,chunk,k", [(4096, 4096, 100), (3 * 65536 + 100, 65536, 20000),
                                       (2 * 65536, 65536, 65000)])
@pytest.mark.parametrize("kind", ["topk", "topk8", "topk_sign"])
def test_topk_equal_magnitudes_take_the_lowest_indices(n, chunk, k, kind):
    # the ties span the kernel's tiles of a chunk (4096 elements): the lowest indices across them win
    update = torch.ones(n) * 0.5
    update[::7] = -0.5
    update[::1001] = 0.75
    chunked_both(kind, update, torch.zeros(n), k, chunk)


@pytest.mark.parametrize("every,k", [(30, 1000), (30, 3000), (17, 2000), (2, 10)])
@pytest.mark.parametrize("kind", ["topk", "topk8", "topk_sign"])
def test_topk_ties_among_the_threshold_bins_elements(every, k, kind):
    # The kernel resolves the bin of the k-th largest in shared memory when it holds few enough elements
    # (here 65536 / every of them equal, among small values), else over the whole chunk (every = 2).
    g = torch.Generator().manual_seed(every)
    n = 2 * 65536 + 999
    update = torch.randn(n, generator=g) * 0.01
    update[::every] = 0.5
    update[1::every * 3] = -0.5
    chunked_both(kind, update, torch.zeros(n), k, 65536)


@pytest.mark.parametrize("kind", ["topk", "topk8", "topk_sign", "ternary"])
def test_chunked_encode_does_not_wait_for_the_device(kind):
    # The message length is fixed, so the host only queues work: with the stream held busy, the encode
    # returns before it runs; the result is the same once it does.
    update, residual = chunked_state(2**20 + 7)
    u, r = gpu(update), gpu(residual)
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time ahead of the encode
    if kind == "ternary":
        msg = ops.encode_ternary(u, r, 0.5, chunk=65536)
    else:
        msg = ops.encode_topk(u, r, 655, chunk=65536, values=TOPK_VALUES[kind])
    assert not stream.query()
    torch.cuda.synchronize()
    r_cpu = residual.clone()
    if kind == "ternary":
        want = ops.encode_ternary(update, r_cpu, 0.5, chunk=65536)
    else:
        want = ops.encode_topk(update, r_cpu, 655, chunk=65536, values=TOPK_VALUES[kind])
    assert_bits_equal(msg, want)
    assert_bits_equal(r, r_cpu)


@pytest.mark.parametrize("kind", ["topk", "topk8", "topk_sign", "ternary"])
@pytest.mark.parametrize("where", [0, 4097, 3 * 4096 + 5])
def test_chunked_nonfinite_marker_like_cpu(kind, where):
    update, residual = chunked_state(3 * 4096 + 17)
    update[where] = float("nan")
    msg = chunked_both(kind, update, residual, 0.5 if kind == "ternary" else 41, 4096)
    assert int(msg[1]) == NONFINITE and int(msg[3]) == where


@pytest.mark.parametrize("kind", ["topk", "topk8", "topk_sign", "ternary"])
@pytest.mark.parametrize("scale", [1.0, -0.5])
def test_chunked_decode_matches_cpu(kind, scale):
    rows = torch.stack([chunked_both(kind, *chunked_state(70001, seed=s), 0.5 if kind == "ternary" else 41, 4096)
                        for s in range(3)])
    d_cpu = torch.randn(70001)
    d_gpu = gpu(d_cpu)
    ops.decode(d_cpu, rows, scale=scale)
    ops.decode(d_gpu, gpu(rows), scale=scale)
    assert_bits_equal(d_gpu, d_cpu)


@pytest.mark.parametrize("kind", ["topk", "topk8", "topk_sign", "ternary"])
def test_chunked_mutations_rejected_like_cpu(kind):
    rng = np.random.default_rng(5)
    base = chunked_both(kind, *chunked_state(10_000), 0.5 if kind == "ternary" else 41, 4096)
    for _ in range(300):
        msg = base.clone()
        i = int(rng.integers(0, msg.numel()))
        msg[i] = int(rng.integers(-2**31, 2**31, dtype=np.int64))
        d_cpu = torch.randn(10_000)
        d_gpu = gpu(d_cpu)
        try:
            ops.decode(d_cpu, msg)
            cpu_err = None
        except gradshare.MessageError as e:
            cpu_err = str(e)
        before = d_gpu.clone()
        try:
            ops.decode(d_gpu, gpu(msg))
            gpu_err = None
        except gradshare.MessageError as e:
            gpu_err = str(e)
        assert gpu_err == cpu_err
        if cpu_err is None:
            assert_bits_equal(d_gpu, d_cpu)
        else:
            assert_bits_equal(d_gpu, before)


@pytest.mark.parametrize("kind", ["strom", "topk", "topk8", "topk_sign", "ternary"])
@pytest.mark.parametrize("n", [1, 4097, 2**20 + 7])
def test_kept_on_the_gpu_matches_in_place_on_the_cpu(kind, n):
    update, residual = make_state(n, 0.05, seed=n)
    enc = {"strom": lambda u, r, **kw: ops.encode(u, r, 1.0, clip=0.5, **kw),
           "topk": lambda u, r, **kw: ops.encode_topk(u, r, 41, chunk=4096, **kw),
           "topk8": lambda u, r, **kw: ops.encode_topk(u, r, 82, chunk=4096, values="int8", **kw),
           "topk_sign": lambda u, r, **kw: ops.encode_topk(u, r, 410, chunk=4096, values="sign", **kw),
           "ternary": lambda u, r, **kw: ops.encode_ternary(u, r, 0.5, chunk=4096, **kw)}[kind]
    r_cpu = residual.clone()
    m_cpu = enc(update, r_cpu)
    r_gpu, kept = gpu(residual), torch.zeros(n, device=DEV)
    m_gpu = enc(gpu(update), r_gpu, kept=kept)
    assert_bits_equal(m_gpu, m_cpu)
    assert_bits_equal(kept, r_cpu)
    assert_bits_equal(r_gpu, residual)


# ---------------------------------------------------------------------------------------------------
# momentum fused into the encoders (velocity=): the GPU against the CPU
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["strom", "strom_bitmap", "topk", "topk8", "topk_sign", "ternary"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 17, TILE + 1, 4097, 2**20 + 7])
@pytest.mark.parametrize("in_place", [True, False])
def test_fused_momentum_matches_cpu(kind, dtype, n, in_place):
    enc = {"strom": lambda u, r, **kw: ops.encode(u, r, 1.0, clip=0.5, **kw),
           "strom_bitmap": lambda u, r, **kw: ops.encode(u, r, 0.01, format="bitmap", **kw),
           "topk": lambda u, r, **kw: ops.encode_topk(u, r, 41, chunk=4096, **kw),
           "topk8": lambda u, r, **kw: ops.encode_topk(u, r, 82, chunk=4096, values="int8", **kw),
           "topk_sign": lambda u, r, **kw: ops.encode_topk(u, r, 410, chunk=4096, values="sign", **kw),
           "ternary": lambda u, r, **kw: ops.encode_ternary(u, r, 0.5, chunk=4096, **kw)}[kind]
    update, residual = make_state(n, 0.05, dtype=dtype, seed=n)
    velocity = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.3
    outs = []
    for dev in ("cpu", DEV):
        r = residual.to(dev, copy=True)
        kept = None if in_place else torch.zeros(n, device=dev)
        new_v = torch.full((n,), 7.0, device=dev)
        v = velocity.to(dev, copy=True)
        msg = enc(update.to(dev, copy=True), r, kept=kept, velocity=v, momentum=0.9, velocity_out=new_v)
        assert_bits_equal(v, velocity)
        outs.append((msg, r if in_place else kept, new_v))
    for a, b in zip(*outs):
        assert_bits_equal(b, a)


# ---------------------------------------------------------------------------------------------------
# the sharing core end to end on the GPU: 2 ranks on one device (gloo stages CUDA tensors through the host)
# ---------------------------------------------------------------------------------------------------

def _train_on(device, front, optimizer):
    import warnings

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradshare import SharedOptimizer, ThresholdState, threshold_hook, verify_replicas
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3)}[optimizer]
    if front == "hook":
        net = DDP(model, device_ids=[0] if device == "cuda" else None)
        opt = make(net.parameters())
        state = ThresholdState(optimizer=opt, link=None)
        net.register_comm_hook(state, threshold_hook)
        sharing = state.sharing
    else:
        net = model
        opt = SharedOptimizer(make(model.parameters()), link=None)
        sharing = opt.sharing
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(1))  # a task it can learn
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(30):
        x = torch.randn(32, 64, generator=g)
        y = (x @ teacher).argmax(dim=1)
        opt.zero_grad()
        loss = F.cross_entropy(net(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(float(loss))
    verify_replicas(model)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy().copy()
    return flat, sharing.step, losses


@pytest.mark.parametrize("front", ["hook", "optimizer"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sharing_on_gpu_tensors_trains_like_on_the_cpu(front, optimizer):
    from gradshare.workers import run_local
    on_gpu = run_local(_train_on, 2, ("cuda", front, optimizer), threads=1, timeout=300)
    on_cpu = run_local(_train_on, 2, ("cpu", front, optimizer), threads=1, timeout=300)
    # every step shared, replicas bitwise identical (verify_replicas in each run), and the GPU run learns as the
    # CPU run does (the kernels agree bit for bit; the model's float arithmetic differs between devices)
    assert on_gpu[0][1] == on_gpu[1][1] == 30 and np.array_equal(on_gpu[0][0], on_gpu[1][0])
    first, last = np.mean(on_gpu[0][2][:5]), np.mean(on_gpu[0][2][-5:])
    assert last < 0.8 * first
    assert abs(last - np.mean(on_cpu[0][2][-5:])) < 0.05 * first
