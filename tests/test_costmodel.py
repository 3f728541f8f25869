import math

import pytest

from gradshare import costmodel as cm


def test_dense_ring_allreduce_bytes_exact():
    assert cm.dense_allreduce_bytes(2, 1000) == 4000.0           # 2*(1/2)*4*1000
    assert cm.dense_allreduce_bytes(4, 1000) == 6000.0           # 2*(3/4)*4*1000
    assert cm.dense_allreduce_bytes(1, 1000) == 0.0
    assert cm.dense_allreduce_bytes(2, 25_000_000) == 100_000_000.0
    assert cm.fp16_allreduce_bytes(4, 1000) == 3000.0


def test_dense_25m_floats_at_100mbit_is_8_seconds_ideal():
    # environment.md measured 9.2 s; the ideal payload time is 8.0 s, the default efficiency covers the rest
    assert cm.transfer_time(cm.dense_allreduce_bytes(2, 25_000_000), 100e6, efficiency=1.0) == pytest.approx(8.0)
    assert cm.transfer_time(cm.dense_allreduce_bytes(2, 25_000_000), 100e6) == pytest.approx(8.0 / 0.87)


def test_powersgd_elements_with_shapes():
    # 256x784 matrix: (256+784)*2*2 = 4160 < 200704 -> compressed to (256+784)*2 = 2080
    # conv 32x1x5x5 -> 32x25: (32+25)*2*2 = 228 < 800 -> compressed to (32+25)*2 = 114
    # 10x4 matrix: (10+4)*2*2 = 56 >= 40 -> uncompressed 40; biases 256 + 32 + 10 uncompressed
    shapes = [(256, 784), (256,), (32, 1, 5, 5), (32,), (10, 4), (10,)]
    assert cm.powersgd_elements(0, rank=2, shapes=shapes) == 2080 + 256 + 114 + 32 + 40 + 10
    assert cm.powersgd_bytes(2, 0, rank=2, shapes=shapes) == 4.0 * (2080 + 256 + 114 + 32 + 40 + 10)
    # rank larger than a side is capped at min(n, m) (torch does the same)
    assert cm.powersgd_elements(0, rank=4, shapes=[(3, 1000)], min_compression_rate=0.1) == (3 + 1000) * 3


def test_powersgd_estimate_without_shapes_is_square_matrix():
    assert cm.powersgd_elements(10_000, rank=2) == (100 + 100) * 2
    assert cm.powersgd_elements(10_001, rank=1) == 101 + 101     # side rounded up


def test_sparse_message_words_and_allgather_exact():
    p = 1_000_000
    assert cm.sparse_message_words(p, 1e-3, "sparse") == 5 + 1000
    assert cm.sparse_message_words(p, 1e-3, "bitmap") == 5 + 62500
    assert cm.sparse_message_words(p, 1e-3) == 1005
    assert cm.sparse_message_words(p, 0.5) == 5 + 62500           # auto: bitmap is smaller
    assert cm.sparse_message_words(17, 0.0, "bitmap") == 5 + 2    # ceil(17/16)
    # (N-1) * (4 * words + 32 for the lengths all-gather: 4 int64)
    assert cm.sparse_allgather_bytes(2, p, 1e-3) == 1 * (4 * 1005 + 32)
    assert cm.sparse_allgather_bytes(4, p, 1e-3) == 3 * (4 * 1005 + 32)
    assert cm.bitmap_allgather_bytes(3, p) == 2 * (4 * 62505 + 32)
    with pytest.raises(ValueError):
        cm.sparse_message_words(p, 1.5)


def test_sharing_falls_back_to_dense_when_allgather_costs_more():
    p = 1_000_000
    d = 1e-2                                         # crossover ~ N > 2/d = 200
    assert not cm.sharing_uses_dense(100, p, d)
    assert cm.sharing_uses_dense(400, p, d)
    assert cm.sharing_bytes(100, p, d) == cm.sparse_allgather_bytes(100, p, d)
    assert cm.sharing_bytes(400, p, d) == cm.dense_allreduce_bytes(400, p) + 399 * 32
    assert cm.sharing_crossover_workers(1e-2) == 200.0
    assert cm.sharing_crossover_workers(0.5) == 32.0              # bitmap cap: 2 / (1/16)
    assert cm.sharing_crossover_workers(0.0) == math.inf
    # bitmap (d >= 1/16): at N = 32 the words are equal and the 5 header words tip it to dense
    assert cm.bitmap_allgather_bytes(32, 1_600_000) == 31 * (4 * 100_005 + 32)
    assert cm.dense_allreduce_bytes(32, 1_600_000) == 12_400_000.0
    assert cm.sharing_uses_dense(32, 1_600_000, 1.0)
    assert not cm.sharing_uses_dense(31, 1_600_000, 1.0)


def test_averaging_bytes_amortised():
    assert cm.averaging_bytes(2, 1000, frequency=5) == 800.0
    assert cm.averaging_bytes(2, 1000, frequency=5, optimizer_state_factor=1) == 1600.0
    assert cm.averaging_bytes(4, 1000, frequency=1) == 6000.0
    with pytest.raises(ValueError):
        cm.averaging_bytes(2, 1000, frequency=0)


def test_tensor_and_pipeline_parallel_formulas():
    # t=2, 1 layer, b*s*h = 4*8*16 = 512 fp16 elements: 4 allreduces * 2*(1/2)*512*2 bytes
    assert cm.tensor_parallel_bytes(2, 1, 4, 8, 16) == 4 * 1024.0
    assert cm.tensor_parallel_bytes(4, 3, 4, 8, 16, microbatches=2) == 4 * (2 * 3 / 4 * 512 * 2) * 3 * 2
    assert cm.pipeline_parallel_bytes(4, 4, 8, 16, microbatches=8) == 2 * 512 * 2 * 8
    assert cm.pipeline_parallel_bytes(1, 4, 8, 16, microbatches=8) == 0.0
    assert cm.pipeline_bubble_fraction(4, 12) == 3 / 15


@pytest.mark.parametrize("text,bps", [("100mbit", 1e8), ("1gbit", 1e9), ("10gbit", 1e10), ("100Mbps", 1e8),
                                      ("12.5MB/s", 1e8), ("2.5e9", 2.5e9), ("512kbit", 512e3)])
def test_parse_bandwidth(text, bps):
    assert cm.parse_bandwidth(text) == pytest.approx(bps)


@pytest.mark.parametrize("bad", ["fast", "", "-1gbit", "0mbit", "10xbit"])
def test_parse_bandwidth_rejects(bad):
    with pytest.raises(ValueError):
        cm.parse_bandwidth(bad)


def test_scheme_costs_step_times_exact():
    link = cm.Link(bandwidth=100e6, latency=0.0, efficiency=1.0)
    p = 1_000_000
    costs = {c.name: c for c in cm.scheme_costs(p, 2, link, compute=0.1, density=1e-3, encode_per_element=0.0,
                                                 decode_per_word=0.0, fp16_per_element=0.0,
                                                 powersgd_per_element=0.0)}
    assert list(costs) == ["allreduce", "fp16", "powersgd", "sharing", "bitmap", "averaging"]
    assert costs["allreduce"].bytes_per_step == 4e6
    assert costs["allreduce"].step_time == pytest.approx(0.1 + 4e6 * 8 / 100e6)      # 0.42 s
    assert costs["fp16"].step_time == pytest.approx(0.1 + 2e6 * 8 / 100e6)           # 0.26 s
    assert costs["sharing"].bytes_per_step == 4 * 1005 + 32
    assert costs["sharing"].step_time == pytest.approx(0.1 + (4 * 1005 + 32) * 8 / 100e6)
    assert costs["averaging"].bytes_per_step == 4e6 / 5
    assert costs["averaging"].step_time == pytest.approx(0.1 + 4e6 * 8 / 100e6 / 5)
    assert costs["powersgd"].bytes_per_step == 4.0 * (1000 + 1000) * 2


def test_scheme_costs_latency_rounds_and_overlap():
    link = cm.Link(bandwidth=1e9, latency=1e-3, efficiency=1.0)
    costs = {c.name: c for c in cm.scheme_costs(1000, 4, link, compute=0.01, overlap=1.0,
                                                 encode_per_element=0.0, decode_per_word=0.0,
                                                 fp16_per_element=0.0, powersgd_per_element=0.0)}
    dense_comm = 6000 * 8 / 1e9 + 6 * 1e-3                     # 2(N-1) rounds
    assert costs["allreduce"].communicate == pytest.approx(dense_comm)
    assert costs["allreduce"].step_time == pytest.approx(0.01)  # fully hidden behind 10 ms of compute
    assert costs["sharing"].step_time > costs["sharing"].compute  # the exchange of messages is not overlapped


def test_speedup_and_single_worker():
    link = cm.Link(bandwidth=1e8, latency=0.0, efficiency=1.0)
    one = cm.scheme_costs(1000, 1, link, compute=0.05)
    assert all(c.bytes_per_step == 0 for c in one)
    assert cm.speedup(one[0], 1) == pytest.approx(1.0)
    two = cm.scheme_costs(25_000_000, 2, link, compute=0.1)
    assert cm.speedup(two[0], 2) == pytest.approx(2 * 0.1 / 8.1)


def test_encode_costs_scale_with_the_work():
    link = cm.Link(bandwidth=1e9, latency=0.0, efficiency=1.0)
    shapes = [(1000, 1000), (1000,)]
    costs = {c.name: c for c in cm.scheme_costs(1_001_000, 2, link, compute=0.1, shapes=shapes, density=1e-3,
                                                 encode_per_element=1e-9, decode_per_word=2e-9,
                                                 fp16_per_element=3e-9, powersgd_per_element=4e-9)}
    assert cm.powersgd_compressed_elements(0, 2, shapes) == 1_000_000
    assert costs["fp16"].encode == pytest.approx(1_001_000 * 3e-9)
    assert costs["powersgd"].encode == pytest.approx(1_000_000 * 4e-9)
    words = 5 + 1001                                            # round(1e-3 * 1_001_000) entries
    assert costs["sharing"].encode == pytest.approx(1_001_000 * 1e-9 + 2 * words * 2e-9)
    assert costs["allreduce"].encode == 0.0


def test_agrees_with_the_exchange_path_choice():
    # the exchange counts its bytes with this module (tests/test_comm.py checks a real exchange's figures)
    comm = pytest.importorskip("gradshare.comm")
    for workers, params, density in [(2, 1_000_000, 1e-3), (8, 50_000, 0.02), (33, 1_600_000, 1.0), (4, 17, 0.5)]:
        words = cm.sparse_message_words(params, density)
        assert cm.sharing_uses_dense(workers, params, density) == comm.prefers_dense(words, params, workers)
    assert cm.ring_allreduce_bytes(3, 10) == 2 * 2 * 10 * 4 // 3 and isinstance(cm.ring_allreduce_bytes(3, 10), int)
    assert cm.fixed_allgather_bytes(4, 100) == 3 * 400
