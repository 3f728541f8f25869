"""Decode fuzzing: random and mutated messages either raise MessageError and leave dst unchanged, or decode
exactly as gradshare.reference.decode does. dst is a view in the middle of a larger buffer whose guard
regions must never change (no write out of bounds)."""
import numpy as np
import pytest
import torch

import gradshare
from gradshare import message as msgfmt
from gradshare import ops, reference
from gradshare.message import BITMAP, HEADER_WORDS, MAGIC_VERSION, NONFINITE, SPARSE

GUARD = 67
SIZES = [0, 1, 2, 15, 16, 17, 31, 32, 33, 100, 257, 1000, 4099]
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


def _f32_bits(x: float) -> int:
    return msgfmt.float_bits(x)


@pytest.fixture(scope="module")
def pool():
    """Valid messages of both formats for several sizes and densities: (n, message)."""
    out = []
    g = torch.Generator().manual_seed(1234)
    for n in SIZES:
        for density in (0.0, 0.01, 0.05, 0.2, 0.7, 1.0):
            for fmt in ("sparse", "bitmap"):
                residual = (torch.rand(n, generator=g) * 2 - 1) * 0.9
                update = torch.where(torch.rand(n, generator=g) < density, 2.0, 0.0) * torch.sign(
                    torch.randn(n, generator=g))
                tau = float(torch.rand(1, generator=g)) + 0.05
                out.append((n, ops.encode(update, residual, tau, format=fmt)))
    return out


class Checker:
    """Decodes into a guarded buffer and compares with the reference; counts the cases run."""

    def __init__(self):
        self.cases = self.accepted = self.rejected = 0

    def __call__(self, n: int, messages, scale: float = 1.0, dst_n=None):
        dst_n = n if dst_n is None else dst_n
        buf = torch.randn(dst_n + 2 * GUARD)
        buf[:GUARD] = float("nan")
        before = buf.clone()
        dst = buf[GUARD:GUARD + dst_n]
        ref = dst.clone()
        kept = [m.clone() for m in messages] if isinstance(messages, list) else messages.clone()
        try:
            reference.decode(ref, messages, scale)
            ref_ok = True
        except ValueError:
            ref_ok = False
        try:
            ops.decode(dst, messages, scale=scale)
            ok = True
        except gradshare.MessageError:
            ok = False
        self.cases += 1
        b, b0 = buf.view(torch.int32), before.view(torch.int32)
        assert torch.equal(b[:GUARD], b0[:GUARD]), "wrote before dst"
        assert torch.equal(b[GUARD + dst_n:], b0[GUARD + dst_n:]), "wrote past dst"
        assert ok == ref_ok, f"native {'accepted' if ok else 'rejected'} what the reference did not"
        if ok:
            self.accepted += 1
            assert torch.equal(dst.view(torch.int32), ref.view(torch.int32))
        else:
            self.rejected += 1
            assert torch.equal(b, b0), "a rejected decode changed dst"
        if isinstance(messages, list):  # decode only reads its messages
            assert all(torch.equal(m, k) for m, k in zip(messages, kept))
        else:
            assert torch.equal(messages, kept)


# ---------------------------------------------------------------------------------------------------
# mutations of one valid message
# ---------------------------------------------------------------------------------------------------

def _payload_len(m):
    return m.numel() - HEADER_WORDS


def mutate(rng: np.random.Generator, n: int, msg: torch.Tensor):
    """One mutation; returns (kind, message, dst_n)."""
    m = msg.clone()
    fmt, count = int(m[1]), int(m[3])
    kinds = ["bitflip", "truncate", "magic", "wrong_n", "count_big", "count_small", "format", "tau", "extend",
             "random_payload", "valid"]
    if fmt == SPARSE and count > 0:
        kinds += ["swap", "duplicate", "zero", "int32_min", "out_of_bounds", "negate", "int32_max"] * 2
    if fmt == BITMAP and n > 0:
        kinds += ["sign_without_present", "past_n", "drop_bit", "add_bit"] * 2
    kind = kinds[rng.integers(len(kinds))]
    dst_n = n
    p = HEADER_WORDS
    if kind == "bitflip":
        for _ in range(rng.integers(1, 4)):
            i = int(rng.integers(m.numel()))
            m[i] = int(np.int32(np.uint32(int(m[i]) & 0xFFFFFFFF) ^ np.uint32(1 << int(rng.integers(32)))))
    elif kind == "truncate":
        m = m[:int(rng.integers(m.numel()))].clone()
    elif kind == "magic":
        m[0] = int(rng.choice([0, MAGIC_VERSION + 1, MAGIC_VERSION - 1, 0x47530002, -1, INT32_MIN]))
    elif kind == "wrong_n":
        dst_n = int(rng.choice([max(n - 1, 0), n + 1, n + 16, max(n - 16, 0), int(rng.integers(0, 5000))]))
        if rng.random() < 0.3:
            m[2] = int(rng.choice([-1, INT32_MIN, INT32_MAX, n + 1]))
            dst_n = n
    elif kind == "count_big":
        m[3] = int(rng.choice([count + 1, count + 2, n, n + 1, INT32_MAX, _payload_len(m) + 1]))
    elif kind == "count_small":
        m[3] = int(rng.choice([count - 1, -1, INT32_MIN, 0]))
    elif kind == "format":
        m[1] = int(rng.choice([SPARSE, BITMAP, NONFINITE, 3, -1, 255, INT32_MIN]))
    elif kind == "tau":
        m[4] = _f32_bits(float(rng.choice([0.0, -0.0, -1.0, np.nan, np.inf, -np.inf, 1e-45, 3.0e38, 2.5])))
    elif kind == "extend":  # padding words after the message are ignored
        m = torch.cat([m, torch.from_numpy(rng.integers(INT32_MIN, INT32_MAX, rng.integers(1, 9), dtype=np.int32))])
    elif kind == "random_payload":
        k = _payload_len(m)
        if k:
            m[p:] = torch.from_numpy(rng.integers(INT32_MIN, INT32_MAX, k, dtype=np.int64).astype(np.int32))
    elif kind == "swap":
        if count >= 2:
            i = int(rng.integers(count - 1))
            a, b = int(m[p + i]), int(m[p + i + 1])
            m[p + i], m[p + i + 1] = b, a
        else:
            m[p] = -int(m[p])
    elif kind == "duplicate":
        if count >= 2:
            i = int(rng.integers(count - 1))
            m[p + i + 1] = -int(m[p + i]) if rng.random() < 0.5 else int(m[p + i])
    elif kind in ("zero", "int32_min", "out_of_bounds", "negate", "int32_max"):
        i = p + int(rng.integers(count))
        m[i] = {"zero": 0, "int32_min": INT32_MIN, "out_of_bounds": int(rng.choice([n + 1, -(n + 1), n + 100])),
                "negate": -int(m[i]), "int32_max": INT32_MAX}[kind]
    elif kind in ("sign_without_present", "past_n", "drop_bit", "add_bit"):
        words = msgfmt.bitmap_words(n)
        if kind == "past_n":
            if n % 16 == 0:
                m[3] = count  # no spare bits in the last word: leave the message valid
            else:
                b = int(rng.integers(n % 16, 16))
                w = int(m[p + words - 1]) & 0xFFFFFFFF
                w |= (1 << b) | ((1 << (b + 16)) if rng.random() < 0.5 else 0)
                m[p + words - 1] = int(np.uint32(w).view(np.int32))
                if rng.random() < 0.5:
                    m[3] = count + 1  # keeps the count consistent so only the bit-past-n check fires
        else:
            i = int(rng.integers(n))
            w, b = int(m[p + i // 16]) & 0xFFFFFFFF, i % 16
            if kind == "sign_without_present":
                w = (w & ~(1 << b)) | (1 << (b + 16))
            elif kind == "drop_bit":
                w &= ~((1 << b) | (1 << (b + 16)))
            else:
                w |= 1 << b
            m[p + i // 16] = int(np.uint32(w).view(np.int32))
    return kind, m, dst_n


def test_fuzz_mutated_single_messages(pool):
    rng = np.random.default_rng(20261122)
    check = Checker()
    kinds = {}
    for _ in range(8000):
        n, msg = pool[int(rng.integers(len(pool)))]
        kind, m, dst_n = mutate(rng, n, msg)
        kinds[kind] = kinds.get(kind, 0) + 1
        scale = float(rng.choice([1.0, 0.5, -3.0]))
        check(n, m, scale, dst_n=dst_n)
    assert check.cases == 8000
    assert check.accepted > 500 and check.rejected > 4000, (check.accepted, check.rejected)
    assert len(kinds) == 22, kinds  # every mutation kind ran


def test_fuzz_several_messages_in_one_call(pool):
    """Lists and padded 2-D rows; one bad message anywhere means nothing is written."""
    rng = np.random.default_rng(7)
    by_n = {}
    for n, m in pool:
        by_n.setdefault(n, []).append(m)
    check = Checker()
    for _ in range(1500):
        n = SIZES[int(rng.integers(len(SIZES)))]
        k = int(rng.integers(1, 5))
        msgs = [by_n[n][int(rng.integers(len(by_n[n])))] for _ in range(k)]
        if rng.random() < 0.6:
            j = int(rng.integers(k))
            _, msgs[j], _ = mutate(rng, n, msgs[j])
        if rng.random() < 0.5:
            check(n, msgs)
        else:
            width = max(m.numel() for m in msgs)
            rows = torch.zeros(k, width, dtype=torch.int32)
            for i, m in enumerate(msgs):
                rows[i, :m.numel()] = m
            check(n, rows, float(rng.choice([1.0, 2.0])))
    assert check.cases == 1500 and check.accepted > 100 and check.rejected > 100


def test_fuzz_random_words(pool):
    """Random headers and payloads (magic word right most of the time, so validation goes deeper)."""
    rng = np.random.default_rng(99)
    check = Checker()
    for _ in range(1500):
        n = int(rng.choice(SIZES))
        fmt = int(rng.choice([SPARSE, BITMAP, SPARSE, BITMAP, NONFINITE, 7]))
        count = int(rng.choice([0, 1, 2, 3, n // 2, n, n + 1, int(rng.integers(0, max(n, 1) + 1))]))
        length = int(rng.choice([0, 1, 4, 5, 6, HEADER_WORDS + count, HEADER_WORDS + msgfmt.bitmap_words(n),
                                 int(rng.integers(0, 40))]))
        words = rng.integers(INT32_MIN, INT32_MAX, max(length, HEADER_WORDS), dtype=np.int64).astype(np.int32)
        if fmt == SPARSE and rng.random() < 0.5:  # mostly ascending indices within bounds
            k = min(count, n, len(words) - HEADER_WORDS)
            idx = np.sort(rng.choice(np.arange(1, n + 1), size=k, replace=False)) if k else np.zeros(0, int)
            words[HEADER_WORDS:HEADER_WORDS + k] = idx * rng.choice([-1, 1], size=k)
        elif fmt == BITMAP and rng.random() < 0.5:  # bitmap-shaped words: sign bits only where present
            present = rng.integers(0, 1 << 16, len(words)).astype(np.uint32)
            words = (present | ((present & rng.integers(0, 1 << 16, len(words)).astype(np.uint32)) << 16)).view(
                np.int32)
        words[:HEADER_WORDS] = [MAGIC_VERSION if rng.random() < 0.9 else int(words[0]), fmt, n, count,
                                _f32_bits(float(rng.choice([0.5, 1e-3, 0.0, np.nan])))]
        check(n, torch.from_numpy(words[:length].copy()))
    assert check.cases == 1500 and check.rejected > 100


# ---------------------------------------------------------------------------------------------------
# named hostile messages (each must be refused)
# ---------------------------------------------------------------------------------------------------

def _sparse(n, entries, count=None, tau=0.5):
    return torch.tensor(msgfmt.header(SPARSE, n, len(entries) if count is None else count, tau) + list(entries),
                        dtype=torch.int32)


def _bitmap(n, words, count, tau=0.5):
    w = [int(np.uint32(x).view(np.int32)) for x in words]
    return torch.tensor(msgfmt.header(BITMAP, n, count, tau) + w, dtype=torch.int32)


HOSTILE = {
    "index_zero": (10, _sparse(10, [0])),
    "index_int32_min": (10, _sparse(10, [INT32_MIN])),
    "index_past_n": (10, _sparse(10, [11])),
    "negative_index_past_n": (10, _sparse(10, [-11])),
    "index_int32_max": (10, _sparse(10, [1, INT32_MAX])),
    "unsorted": (10, _sparse(10, [3, 2])),
    "duplicate": (10, _sparse(10, [3, 3])),
    "duplicate_opposite_sign": (10, _sparse(10, [3, -3])),
    "count_past_row": (10, _sparse(10, [1, 2], count=3)),
    "count_past_n": (2, _sparse(2, [1, 2], count=3)),
    "count_negative": (10, _sparse(10, [], count=-1)),
    "count_int32_max": (10, _sparse(10, [1], count=INT32_MAX)),
    "bad_magic": (10, torch.tensor([0x47530002, SPARSE, 10, 0, _f32_bits(0.5)], dtype=torch.int32)),
    "unknown_format": (10, torch.tensor([MAGIC_VERSION, 3, 10, 0, _f32_bits(0.5)], dtype=torch.int32)),
    "nonfinite_marker": (10, msgfmt.nonfinite_marker(10, 0.5, 4)),
    "tau_zero": (10, _sparse(10, [1], tau=0.0)),
    "tau_negative": (10, _sparse(10, [1], tau=-0.5)),
    "tau_nan": (10, _sparse(10, [1], tau=float("nan"))),
    "tau_inf": (10, _sparse(10, [1], tau=float("inf"))),
    "n_negative": (10, torch.tensor([MAGIC_VERSION, SPARSE, -10, 0, _f32_bits(0.5)], dtype=torch.int32)),
    "header_only_4_words": (10, _sparse(10, [])[:4]),
    "empty": (10, torch.zeros(0, dtype=torch.int32)),
    "bitmap_sign_without_present": (10, _bitmap(10, [1 << 16 | 0], 0)),
    "bitmap_bit_past_n": (10, _bitmap(10, [1 << 12], 1)),
    "bitmap_bit_past_n_17": (17, _bitmap(17, [0, 1 << 1], 1)),
    "bitmap_count_mismatch": (10, _bitmap(10, [0b111], 2)),
    "bitmap_short_payload": (40, _bitmap(40, [1, 1], 2)),
    "bitmap_for_n0_with_count": (0, _bitmap(0, [], 1)),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_message_is_refused(name):
    n, msg = HOSTILE[name]
    buf = torch.full((n + 2 * GUARD,), 7.0)
    with pytest.raises(gradshare.MessageError, match=r"^message 0: "):
        ops.decode(buf[GUARD:GUARD + n], msg)
    assert bool((buf == 7.0).all())
    with pytest.raises(ValueError):
        reference.decode(torch.zeros(n), msg)


@pytest.mark.parametrize("name,n,msg", [
    ("subnormal_tau", 10, _sparse(10, [1, -10], tau=1e-45)),
    ("largest_tau", 10, _sparse(10, [-1, 10], tau=3.4028234663852886e38)),
    ("all_indices", 5, _sparse(5, [1, -2, 3, -4, 5])),
    ("bitmap_full_last_word", 16, _bitmap(16, [0xFFFF | 0xAAAA << 16], 16)),
    ("empty_sparse_n0", 0, _sparse(0, [])),
    ("empty_bitmap_n0", 0, _bitmap(0, [], 0)),
])
def test_edge_messages_are_accepted(name, n, msg):
    buf = torch.full((n + 2 * GUARD,), 7.0)
    dst = buf[GUARD:GUARD + n]
    ref = dst.clone()
    ops.decode(dst, msg)
    reference.decode(ref, msg)
    assert torch.equal(dst.view(torch.int32), ref.view(torch.int32))
    assert bool((buf[:GUARD] == 7.0).all() and (buf[GUARD + n:] == 7.0).all())


@pytest.mark.parametrize("scale", [2.0, -2.0, 1e30])
def test_tau_times_scale_overflow_is_refused(scale):
    msg = _sparse(10, [1, -2], tau=3.0e38)
    buf = torch.full((10 + 2 * GUARD,), 7.0)
    with pytest.raises(gradshare.MessageError, match=r"^message 0: .*overflow"):
        ops.decode(buf[GUARD:GUARD + 10], msg, scale=scale)
    assert bool((buf == 7.0).all())
    ops.decode(buf[GUARD:GUARD + 10], msg, scale=1.0)  # the same message at scale 1 is fine
    assert buf[GUARD] == np.float32(7.0) + np.float32(3.0e38)
