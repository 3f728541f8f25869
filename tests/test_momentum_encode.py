"""Momentum correction fused into the encoders (velocity=, momentum=, velocity_out= of gradshare.ops):
the same message, kept residual and new velocity, bit for bit, as the three steps it replaces (the velocity
update in torch, the encode, and the velocity zeroed where the message sent), for every encoder, dtype and
size, in place and with a separate kept buffer; the pure-torch path (tracing, no native library) alike;
non-finite input leaves residual and velocity as they were; bad buffers are refused by name.
(An exchange with a fused momentum between two ranks: tests/test_comm.py.)"""
import pytest
import torch

from gradshare import ops, reference
from gradshare import _native
from gradshare.message import NONFINITE
from op_inputs import assert_bits_equal

# topk_64k*: TopK's 65536-element chunks, whose selection starts from a sample of the chunk (csrc/cpu/chunked.cpp)
KINDS = ["strom", "strom_bitmap", "topk", "topk8", "topk_sign", "topk_64k8", "topk_64k_sign", "ternary"]
M = 0.9


def _encode(kind, update, residual, **kw):
    if kind == "strom":
        return ops.encode(update, residual, 0.5, on_nonfinite="flag", **kw)
    if kind == "strom_bitmap":
        return ops.encode(update, residual, 0.05, format="bitmap", clip=2.0, on_nonfinite="flag", **kw)
    if kind == "topk":
        return ops.encode_topk(update, residual, 40, chunk=1000, **kw)
    if kind == "topk8":
        return ops.encode_topk(update, residual, 40, chunk=1000, values="int8", **kw)
    if kind == "topk_sign":
        return ops.encode_topk(update, residual, 40, chunk=1000, values="sign", **kw)
    if kind == "topk_64k8":
        return ops.encode_topk(update, residual, 655, chunk=65536, values="int8", **kw)
    if kind == "topk_64k_sign":
        return ops.encode_topk(update, residual, 655, chunk=65536, values="sign", **kw)
    return ops.encode_ternary(update, residual, 0.5, chunk=1024, **kw)


def _state(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g),
            torch.randn(n, generator=g) * 0.1)


def _composed(kind, update, velocity, residual):
    """The three steps a fused encode replaces: (message, kept residual, new velocity)."""
    w = torch.mul(velocity, M).add_(update)
    r = residual.clone()
    msg = _encode(kind, w, r)
    if int(msg[1]) != NONFINITE:
        w.masked_fill_(reference.sent_mask(msg, w.numel()), 0.0)
    return msg, r, w


def _fused(kind, update, velocity, residual, in_place):
    r = residual.clone()
    kept = None if in_place else torch.full_like(residual, 5.0)
    new_v = torch.full_like(velocity, 7.0)
    msg = _encode(kind, update, r, kept=kept, velocity=velocity, momentum=M, velocity_out=new_v)
    if not in_place:
        assert_bits_equal(r, residual)  # only read
    return msg, (r if in_place else kept), new_v


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 63, 1000, 5003, 300_001])
@pytest.mark.parametrize("in_place", [True, False])
def test_fused_equals_the_composed_steps(kind, dtype, n, in_place):
    update, velocity, residual = _state(n, dtype, seed=n)
    before = velocity.clone()
    got = _fused(kind, update, velocity, residual, in_place)
    want = _composed(kind, update, velocity, residual)
    for a, b in zip(got, want):
        assert_bits_equal(a, b)
    assert_bits_equal(velocity, before)
    assert (got[2] == 0).sum() >= int(reference.sent_mask(got[0], n).sum())  # something was masked


@pytest.mark.parametrize("kind", KINDS)
def test_pure_torch_path_equals_the_kernel(kind, monkeypatch):
    update, velocity, residual = _state(20_000, torch.float32, seed=3)
    native = _fused(kind, update, velocity, residual, in_place=False)
    monkeypatch.setattr(_native, "available", lambda: False)
    composed = _fused(kind, update, velocity, residual, in_place=False)
    for a, b in zip(native, composed):
        assert_bits_equal(a, b)


def test_sent_mask_marks_selected_entries_even_when_their_value_rounds_to_zero():
    # 8-bit top-k: the second entry quantizes to 0 against the chunk's largest, but it was selected.
    update = torch.tensor([100.0, 0.1, 0.0, 0.0])
    msg = ops.encode_topk(update, torch.zeros(4), 2, chunk=4, values="int8")
    assert reference.sent_mask(msg, 4).tolist() == [True, True, False, False]
    new_v = torch.empty(4)
    ops.encode_topk(update, torch.zeros(4), 2, chunk=4, values="int8", velocity=torch.ones(4), momentum=0.5,
                    velocity_out=new_v)
    assert new_v.tolist() == [0.0, 0.0, 0.5, 0.5]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("where", ["update", "velocity"])
def test_nonfinite_input_changes_neither_residual_nor_velocity(kind, in_place, where):
    update, velocity, residual = _state(9000, torch.float32, seed=1)
    (update if where == "update" else velocity)[4321] = float("nan")
    v0, r0 = velocity.clone(), residual.clone()
    r = residual.clone()
    kept = None if in_place else torch.empty(9000)
    msg = _encode(kind, update, r, kept=kept, velocity=velocity, momentum=M, velocity_out=torch.empty(9000))
    assert int(msg[1]) == NONFINITE and int(msg[3]) == 4321
    assert_bits_equal(r, r0)
    assert_bits_equal(velocity, v0)


def test_bad_buffers_are_refused_by_name():
    update, velocity, residual = _state(100, torch.float32)
    out = torch.full((100,), 3.0)
    r0 = residual.clone()
    with pytest.raises(ValueError, match="velocity and velocity_out"):
        ops.encode_topk(update, residual, 5, velocity=velocity)
    with pytest.raises(ValueError, match="velocity_out: shares memory with update"):
        ops.encode_topk(update, residual, 5, velocity=velocity, velocity_out=update)
    with pytest.raises(ValueError, match="velocity_out: shares memory with velocity"):
        ops.encode_ternary(update, residual, velocity=velocity, velocity_out=velocity)
    with pytest.raises(ValueError, match="velocity_out: shares memory with kept"):
        kept = torch.empty(100)
        ops.encode(update, residual, 0.5, kept=kept, velocity=velocity, velocity_out=kept)
    with pytest.raises(ValueError, match="velocity: shares memory with residual"):
        ops.encode(update, residual, 0.5, velocity=residual, velocity_out=out)
    with pytest.raises(ValueError, match="velocity: 99 elements"):
        ops.encode(update, residual, 0.5, velocity=velocity[:99], velocity_out=out)
    with pytest.raises(TypeError, match="velocity_out: dtype float16"):
        ops.encode(update, residual, 0.5, velocity=velocity, velocity_out=out.half())
    with pytest.raises(ValueError, match="momentum: must be a finite"):
        ops.encode(update, residual, 0.5, velocity=velocity, momentum=float("inf"), velocity_out=out)
    assert_bits_equal(out, torch.full((100,), 3.0))  # nothing above wrote
    assert_bits_equal(residual, r0)


def test_sent_mask_op_has_a_sound_fake_kernel():
    update, velocity, residual = _state(3000, torch.float32)
    for kind in KINDS:
        msg = _encode(kind, update, residual.clone())
        torch.library.opcheck(torch.ops.gradshare.sent_mask.default, (msg, 3000))


def _step(update, velocity, residual, kept, new_v):
    msg = ops.encode_topk(update, residual, 30, chunk=1000, kept=kept, velocity=velocity, momentum=M,
                          velocity_out=new_v)
    return msg, kept * 2.0, new_v + 1.0


def test_torch_compile_matches_eager():
    torch._dynamo.reset()
    update, velocity, residual = _state(4000, torch.float32, seed=9)
    eager = _step(update, velocity, residual, torch.empty(4000), torch.empty(4000))
    compiled = torch.compile(_step, backend="aot_eager")(update, velocity, residual, torch.empty(4000),
                                                         torch.empty(4000))
    for a, b in zip(compiled, eager):
        assert_bits_equal(a, b)
