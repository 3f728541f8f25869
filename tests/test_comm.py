import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gradshare import TopK, Ternary, ops, reference
from gradshare.comm import NonFiniteStepError, any_nonfinite, exchange, exchange_async, grads_nonfinite, prefers_dense
from gradshare.costmodel import allgather_bytes, ring_allreduce_bytes
from gradshare.compression import Strom
from gradshare.message import HEADER_WORDS
from gradshare.workers import run_local


def _data(rank, n, scale):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, generator=g) * scale, torch.randn(n, generator=g) * scale * 0.1


def _np(t):
    return t.detach().cpu().numpy().copy()


def _exchange_vs_reference(n, tau):
    warnings.simplefilter("ignore")
    r = dist.get_rank()
    # Rank r has a different spread, so messages differ in length and rows are padded.
    upd, res = _data(r, n, 0.01 * (r + 1))
    mine_res = res.clone()
    msg = ops.encode(upd, mine_res, tau)                    # what this rank should send
    res_sync, res_async = res.clone(), res.clone()
    a = exchange(upd.clone(), res_sync, tau)
    b = exchange_async(upd.clone(), res_async, tau).wait()
    return {"msg": _np(msg), "out": _np(a.out), "out_async": _np(b.out), "words": a.words, "format": a.format,
            "residual_ok": torch.equal(res_sync, mine_res) and torch.equal(res_async, mine_res),
            "bytes": a.bytes_sent, "dense": a.dense_bytes}


@pytest.mark.slow
def test_exchange_equals_reference_sum_of_decoded_messages_4_ranks():
    res = run_local(_exchange_vs_reference, 4, (3000, 0.02), timeout=120)
    _check_reference(res, 3000, 4)


def _check_reference(res, n, world):
    ref = torch.zeros(n)
    ops.decode(ref, [torch.from_numpy(r["msg"]) for r in res], scale=1.0 / world)
    for r in res:
        assert np.array_equal(r["out"], ref.numpy())
        assert np.array_equal(r["out_async"], ref.numpy())
        assert r["residual_ok"]
        assert r["words"] == [len(x["msg"]) for x in res]
    words = res[0]["words"]
    assert len(set(words)) > 1                                   # padding was exercised
    assert res[0]["bytes"] == allgather_bytes(world, max(words))
    assert res[0]["dense"] == ring_allreduce_bytes(world, n)


def _pipelined(n, k):
    warnings.simplefilter("ignore")
    r = dist.get_rank()
    bufs = [_data(r * 10 + i, n + 37 * i, 0.01) for i in range(k)]
    futs = [exchange_async(u.clone(), res.clone(), 0.01, nonfinite="raise") for u, res in bufs]
    outs = [_np(f.wait().out) for f in futs]
    seq = [_np(exchange(u.clone(), res.clone(), 0.01).out) for u, res in bufs]
    return outs, seq


def _reference_and_pipelined(n, tau):
    return _exchange_vs_reference(n, tau), _pipelined(2000, 4)


@pytest.mark.slow
def test_pipelined_async_exchanges_match_sequential_ones_and_reference():
    by_rank = run_local(_reference_and_pipelined, 2, (3000, 0.02), timeout=120)
    _check_reference([x[0] for x in by_rank], 3000, 2)
    res = [x[1] for x in by_rank]
    for outs, seq in res:
        for a, b in zip(outs, seq):
            assert np.array_equal(a, b)
    for a, b in zip(res[0][0], res[1][0]):
        assert np.array_equal(a, b)


def _fallbacks(cases):
    return [_fallback(n, mode) for n, mode in cases]


def _fallback(n, mode):
    r = dist.get_rank()
    upd, res = _data(r, n, 0.01)
    total = (upd + res).clone()
    out = exchange(upd.clone(), res, 0.005, fallback=mode, clip=None)
    return {"format": out.format, "out": _np(out.out), "residual_zero": bool((res == 0).all()),
            "total": _np(total), "bytes": out.bytes_sent, "dense": out.dense_bytes}


@pytest.mark.slow
def test_dense_fallback_sends_residual_plus_update_and_zeroes_residual():
    cases = [(4, "auto"), (1000, "always")]            # auto: a 4-element buffer loses to its headers
    by_rank = run_local(_fallbacks, 2, (cases,), timeout=120)
    for i in range(len(cases)):
        res = [by_rank[0][i], by_rank[1][i]]
        mean = (res[0]["total"] + res[1]["total"]) / 2
        for r in res:
            assert r["format"] == "dense"
            assert r["residual_zero"]
            np.testing.assert_allclose(r["out"], mean, rtol=1e-5, atol=1e-7)
            assert r["bytes"] >= r["dense"]
        assert np.array_equal(res[0]["out"], res[1]["out"])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_any_nonfinite_finds_one_bad_element_and_not_a_finite_overflow(bad, dtype):
    big = torch.finfo(dtype).max
    finite = [torch.randn(1000).to(dtype), torch.full((4,), big, dtype=dtype)]   # sums overflow, all finite
    assert any_nonfinite(finite).tolist() == [0.0]
    assert any_nonfinite([]).tolist() == [0.0]
    assert any_nonfinite([torch.empty(0, dtype=dtype)] + finite + [torch.ones(3)]).tolist() == [0.0]
    for where in (0, 511, 999):
        t = torch.randn(1000).to(dtype)
        t[where] = bad
        assert any_nonfinite(finite + [t]).tolist() == [1.0], where
    both = torch.tensor([float("inf"), float("-inf")], dtype=dtype)            # sums to NaN
    assert any_nonfinite([both]).tolist() == [1.0]
    sparse = torch.sparse_coo_tensor([[0, 7]], torch.tensor([1.0, bad]), (9,)).to(dtype)     # its stored values
    assert any_nonfinite([torch.ones(2), sparse]).tolist() == [1.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_grads_nonfinite_is_any_nonfinite_and_leaves_every_value_as_it_was(bad):
    def grads():
        g = torch.Generator().manual_seed(3)
        special = torch.tensor([-0.0, 1e-40, -1e-42, torch.finfo(torch.float32).max, 0.0])   # signed zero, subnormals
        return [torch.randn(1000, generator=g), torch.randn(7, 5, generator=g).t(), special,   # a strided one
                torch.randn(300, generator=g).half(), torch.randn(300, generator=g).bfloat16(),
                torch.randn(50, generator=g).double(), torch.empty(0),
                torch.sparse_coo_tensor([[0, 7]], torch.tensor([1.0, 2.0]), (9,)),
                torch.randn(20, generator=g).requires_grad_()]                  # a gradient in a graph
    clean = grads()
    before = [t.detach().clone() for t in clean]
    assert grads_nonfinite(clean).tolist() == [0.0] == any_nonfinite(clean).tolist()
    for t, b in zip(clean, before):                      # the same bits: -0 stays -0, subnormals stay
        if t.is_sparse:
            assert torch.equal(t.to_dense(), b.to_dense())
        else:
            assert torch.equal(t.detach().reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    assert grads_nonfinite([]).tolist() == [0.0]
    for i in (0, 1, 3, 4, 5, 7, 8):                       # one bad element in any tensor, any dtype, sparse or in a graph
        gs = grads()
        t = gs[i]
        if t.is_sparse:
            gs[i] = torch.sparse_coo_tensor([[0, 7]], torch.tensor([1.0, bad]), (9,))
        else:
            with torch.no_grad():
                t[tuple(s // 2 for s in t.shape)] = bad
        assert grads_nonfinite(gs).tolist() == [1.0] == any_nonfinite(gs).tolist(), i


def test_break_even_rule():
    # Padded gather moves (W-1)*L words, a ring allreduce 2(W-1)/W*n: dense once W*L > 2n.
    assert not prefers_dense(HEADER_WORDS + 100, 1000, 2)
    assert prefers_dense(1001, 1000, 2)
    assert not prefers_dense(1000, 1000, 2)
    assert prefers_dense(HEADER_WORDS + 1, 8, 4)             # tiny buffers lose to their headers
    n = 16 * 10**6                                           # a bitmap row (n/16 + 5 words) loses from W = 32
    assert not prefers_dense(HEADER_WORDS + n // 16, n, 31) and prefers_dense(HEADER_WORDS + n // 16, n, 32)
    assert not prefers_dense(10**6, 10, 1)


def _nonfinite_both():
    warnings.simplefilter("ignore")
    return _nonfinite("raise", 1), _nonfinite("skip", 0)


def _nonfinite(policy, bad_rank):
    r = dist.get_rank()
    n = 500
    upd, res = _data(r, n, 0.01)
    if r == bad_rank:
        upd[123] = float("nan")
    before = res.clone()
    backup = torch.empty_like(res)
    out = {}
    try:
        e = exchange(upd, res, 0.01, backup=backup, nonfinite=policy, step=7, name="bucket 0")
        out["skipped"] = e.skipped
        out["nonfinite_ranks"] = e.nonfinite_ranks
        out["out_zero"] = bool((e.out == 0).all())
    except NonFiniteStepError as err:
        out["error"] = str(err)
        out["ranks"] = err.ranks
    out["residual_unchanged"] = torch.equal(res, before)
    # The group still works afterwards (nobody hangs or is left mid-collective).
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = float(t)
    return out


@pytest.mark.slow
def test_nonfinite_raise_stops_every_rank_and_skip_drops_the_step():
    by_rank = run_local(_nonfinite_both, 2, timeout=120, collective_timeout=30)
    for r in (x[0] for x in by_rank):            # raise: every rank errors, naming step and rank
        assert "skipped" not in r
        assert r["ranks"] == [1]
        assert "step 7" in r["error"] and "rank 1" in r["error"] and "element 123" in r["error"]
        assert r["after"] == 2.0
    for r in (x[1] for x in by_rank):            # skip: dropped everywhere, residual untouched
        assert r["skipped"] and r["nonfinite_ranks"] == [0]
        assert r["residual_unchanged"] and r["out_zero"]
        assert r["after"] == 2.0


# -- momentum fused into the encode (velocity=): the same as the velocity update, exchange and mask apart --
def _fused_momentum_exchanges(seed):
    """Per case: the fused exchange's and the composed one's (out, kept, new velocity), on this rank."""
    rank = dist.get_rank()
    n = 50_000
    cases = {"topk": (TopK(0.02, warmup_steps=0), "auto"), "topk_dense": (TopK(0.02, warmup_steps=0), "always"),
             "ternary": (Ternary(), "auto"), "strom": (Strom(0.5), "auto"),
             "strom_dense": (Strom(0.5), "always")}
    results = {}
    for name, (codec, fallback) in cases.items():
        g = torch.Generator().manual_seed(seed + rank)
        update, velocity, residual = (torch.randn(n, generator=g), torch.randn(n, generator=g),
                                      torch.randn(n, generator=g) * 0.1)
        runs = []
        for fused in (True, False):
            kept, new_v, out = torch.empty(n), torch.empty(n), torch.empty(n)
            if fused:
                r = exchange_async(update, residual, encoder=codec.clone(), out=out, fallback=fallback, kept=kept,
                                   velocity=(velocity, 0.9, new_v)).wait()
            else:
                w = torch.mul(velocity, 0.9).add_(update)
                r = exchange_async(w, residual, encoder=codec.clone(), out=out, fallback=fallback,
                                   kept=kept).wait()
                if r.format == "dense":
                    w.zero_()
                else:
                    w.masked_fill_(reference.sent_mask(r.message, n), 0.0)
                new_v = w
            runs.append((r.format, out.numpy().copy(), kept.numpy().copy(), new_v.numpy().copy()))
        results[name] = runs
    return results


def test_exchange_with_fused_momentum_equals_the_composed_exchange():
    for rank_result in run_local(_fused_momentum_exchanges, 2, (11,), timeout=300):
        formats = {}
        for name, (fused, composed) in rank_result.items():
            assert fused[0] == composed[0]
            formats[name] = fused[0]
            for a, b in zip(fused[1:], composed[1:]):
                assert np.array_equal(a.view(np.int32), b.view(np.int32)), name
        assert formats["topk_dense"] == "dense" and formats["strom_dense"] == "dense"
        assert formats["topk"] == "topk8" and formats["ternary"] == "ternary"



# -- apply_later: the mean decoded straight into the caller's buffer, minus it, once the caller says so --
def _apply_later():
    warnings.simplefilter("ignore")
    r = dist.get_rank()
    out = {}
    for name, encoder, n, fallback in (("topk", TopK(0.05, values="sign", warmup_steps=0), 5000, "auto"),
                                       ("dense", TopK(0.05, warmup_steps=0), 4, "auto"),  # 4 elements: dense
                                       ("varying", None, 3000, "auto")):
        upd, res = _data(r, n, 0.01 * (r + 1))
        kwargs = dict(encoder=encoder) if encoder is not None else dict(tau=0.01)
        plain = exchange_async(upd.clone(), res.clone(), kept=torch.empty(n), fallback=fallback, **kwargs).wait()
        kept = torch.empty(n)
        later = exchange_async(upd.clone(), res.clone(), kept=kept, fallback=fallback, apply_later=True,
                               **kwargs).wait()
        dst = torch.linspace(-1, 1, n)
        expected = dst - plain.out
        before = dst.clone()
        later.subtract_from(dst)
        try:
            later.subtract_from(dst)
            twice = "applied twice"
        except RuntimeError as e:
            twice = str(e)
        out[name] = {"format": later.format, "out": later.out, "dst": _np(dst), "expected": _np(expected),
                     "moved": not torch.equal(dst, before), "twice": twice,
                     "kept_zero_if_dense": later.format != "dense" or bool((kept == 0).all())}
    # A skipped step (a non-finite update on rank 1, nonfinite="skip") has nothing to apply.
    upd, res = _data(r, 500, 0.01)
    if r == 1:
        upd[7] = float("nan")
    skipped = exchange_async(upd, res, encoder=TopK(0.05, warmup_steps=0), kept=torch.empty(500),
                             nonfinite="skip", apply_later=True).wait()
    out["skipped"] = (skipped.skipped, skipped.out is None, skipped.pending is None)
    with pytest.raises(ValueError, match="apply_later"):
        exchange_async(upd, res, tau=0.01, out=torch.empty(500), apply_later=True)
    return out


def test_apply_later_subtracts_the_mean_from_the_buffer_named_afterwards():
    by_rank = run_local(_apply_later, 2, timeout=120)
    for name, fmt in (("topk", "topk_sign"), ("dense", "dense"), ("varying", None)):
        a, b = by_rank[0][name], by_rank[1][name]
        if fmt is not None:
            assert a["format"] == fmt
        assert a["out"] is None and a["moved"] and "applied already" in a["twice"] and a["kept_zero_if_dense"]
        np.testing.assert_allclose(a["dst"], a["expected"], rtol=1e-6, atol=1e-7)
        assert np.array_equal(a["dst"], b["dst"])            # the same bits on every rank
    assert by_rank[0]["skipped"] == by_rank[1]["skipped"] == (True, True, True)
