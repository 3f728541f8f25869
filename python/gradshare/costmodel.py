"""Bytes and step time of each data-parallel scheme, from first principles.

Use this to decide, before training, which exchange a model, a worker count and a link call for
(`gradshare plan` is the command-line front end), and to check measured byte counts against what a
scheme should move. All byte counts are payload bytes that ONE worker sends per training step
(collectives here are symmetric: a worker receives as much as it sends). Wire overhead (TCP/IP and
Ethernet headers, about 4-5% at a 1500-byte MTU) is not included; :func:`transfer_time` accounts for it
through ``efficiency``.

Formulas (N workers, P float32 parameters, 4 bytes each):

* dense ring allreduce: reduce-scatter then all-gather, each moving (N-1)/N of the buffer:
  ``2 (N-1)/N * 4P``; ``2 (N-1)`` latency rounds.
* fp16 allreduce (``fp16_compress_hook``): the same with 2-byte elements: ``2 (N-1)/N * 2P``.
* PowerSGD rank r (Vogels et al. 2019, torch ``powerSGD_hook``): each parameter with 2+ dimensions is
  viewed as an ``n x m`` matrix (``n = shape[0]``); when ``(n + m) r * min_compression_rate < n m`` it is
  compressed to P (n x r') and Q (m x r'), ``r' = min(n, m, r)``, each ring-allreduced; other tensors are
  allreduced uncompressed. Without shapes the model is estimated as one square matrix (a lower bound).
* gradshare gradient sharing: each worker's message is ``5 + payload`` int32 words (header of 5 words;
  sparse payload 1 word per +-tau entry; bitmap payload ``ceil(P/16)`` words; the smaller is used). The
  exchange is an all-gather padded to the longest message, so a worker sends ``(N-1) * 4 * max_words``
  bytes, plus one all-gather of the message lengths (4 int64 per rank: ``(N-1) * 32`` bytes). This is
  O(N d P) per worker while the dense ring allreduce is O(P): the all-gather stops paying once
  ``N * (5 + d P) > 2 P`` words (roughly ``N > 2 / d``; ``N > 32`` for the bitmap). There gradshare's
  exchange (gradshare.comm, ``fallback="auto"``) allreduces the residual + update densely for that step,
  decided per step from the gathered lengths, so it never moves more than the dense allreduce plus the
  lengths exchange. (A hierarchical or tree exchange would push the crossover further; gradshare does not
  implement one.)
* parameter averaging every k steps (``frequency``): one dense allreduce of the parameters (and, when
  ``optimizer_state_factor > 0``, of that many parameter-sized optimizer buffers: momentum = 1, Adam = 2),
  amortised over k steps.
* tensor parallelism (Megatron-LM, Shoeybi et al. 2019; Narayanan et al. 2021): per transformer layer and
  micro-batch, 2 allreduces of the ``b s h`` activations in the forward pass and 2 in the backward pass,
  each a ring allreduce over the t tensor-parallel ranks: ``4 * 2 (t-1)/t * b s h * bytes``.
* pipeline parallelism: per micro-batch each stage boundary carries the ``b s h`` activations forward and
  their gradients backward (point to point): a middle stage sends ``2 * b s h * bytes`` per micro-batch;
  the pipeline bubble idles a fraction ``(p-1)/(m+p-1)`` of the step (GPipe / 1F1B schedules).

Step time: ``compute + encode + bytes * 8 / (bandwidth * efficiency) + rounds * latency``, with an optional
``overlap`` (the fraction of compute under which communication can hide, as DDP hides bucket allreduces
behind the backward pass).
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from gradshare._deprecation import renamed_kwargs
from gradshare.message import HEADER_WORDS, LENGTHS_WORDS, bitmap_words

FLOAT32_BYTES = 4
FLOAT16_BYTES = 2
WORD_BYTES = 4            # one int32 message word
LENGTH_BYTES = 8 * LENGTHS_WORDS   # per rank in the lengths all-gather (gradshare.message)

# Defaults measured on the project machine (one thread, a loaded 2-core host, 9M-element buffers): gradshare's
# native encode ~2.5 ns/element (TopK at 2% and Ternary on the 3.7M MLP: 8-9 ms; bench/kernels.py) and
# decode ~10 ns per received message word; fp16 compress + decompress
# ~5 ns/element; PowerSGD rank 2 (error feedback, two matmuls, QR, new residual) ~20 ns per element of the
# compressed matrices. TCP over a veth carried a 100 MB ring allreduce at 100 Mbit/s in 9.2 s against 8.0 s ideal.
ENCODE_SECONDS_PER_ELEMENT = 2.5e-9
DECODE_SECONDS_PER_WORD = 10e-9
FP16_SECONDS_PER_ELEMENT = 5e-9
POWERSGD_SECONDS_PER_ELEMENT = 20e-9
LINK_EFFICIENCY = 0.87
LATENCY_SECONDS = 100e-6  # one message round on a LAN


# ----------------------------------------------------------------------------------------------- bytes
# The one home of what a collective sends: every byte count in gradshare (the exchange's statistics,
# ParameterAveraging, the cost model, `gradshare plan`) comes from these functions. Whole bytes per worker.
def ring_allreduce_bytes(workers: int, elements: int, element_bytes: int = FLOAT32_BYTES) -> int:
    """Bytes one worker sends in a ring allreduce of ``elements`` values: 2 (N-1)/N * elements * size."""
    _check(workers, elements)
    return 2 * (workers - 1) * elements * element_bytes // workers


def fixed_allgather_bytes(workers: int, message_words: int) -> int:
    """Bytes per worker of an all-gather of int32 messages whose length every rank knows (TopK, Ternary)."""
    _check(workers, message_words)
    return (workers - 1) * message_words * WORD_BYTES


def dense_allreduce_bytes(workers: int, params: int) -> int:
    """Plain DDP (float32 gradients, ring allreduce)."""
    return ring_allreduce_bytes(workers, params, FLOAT32_BYTES)


def fp16_allreduce_bytes(workers: int, params: int) -> int:
    """DDP with ``fp16_compress_hook`` (or bf16): half the dense bytes."""
    return ring_allreduce_bytes(workers, params, FLOAT16_BYTES)


def powersgd_elements(params: int, rank: int = 2, shapes: Optional[Sequence[Sequence[int]]] = None,
                      min_compression_rate: float = 2.0) -> int:
    """Float32 elements PowerSGD allreduces per step (P and Q factors plus uncompressed tensors).

    ``shapes``: the parameter shapes (as torch's hook sees them); without them the model is taken as one
    square ``sqrt(P) x sqrt(P)`` matrix, the best case (a lower bound on the real traffic)."""
    return _powersgd_split(params, rank, shapes, min_compression_rate)[0]


def powersgd_compressed_elements(params: int, rank: int = 2, shapes=None, min_compression_rate: float = 2.0) -> int:
    """Elements of the matrices PowerSGD compresses (what its encode work scales with)."""
    return _powersgd_split(params, rank, shapes, min_compression_rate)[1]


def _powersgd_split(params, rank, shapes, min_compression_rate) -> Tuple[int, int]:
    if shapes is None:
        side = math.isqrt(params)
        if side * side < params:
            side += 1
        shapes = [(side, side)] if params > 0 else []
    total = compressed = 0
    for shape in shapes:
        shape = tuple(int(s) for s in shape)
        numel = math.prod(shape) if shape else 1
        if len(shape) <= 1:
            total += numel
            continue
        n, m = shape[0], numel // shape[0]
        if (n + m) * rank * min_compression_rate < n * m:
            total += (n + m) * min(n, m, rank)
            compressed += numel
        else:
            total += numel
    return total, compressed


def powersgd_bytes(workers: int, params: int, rank: int = 2, shapes=None, min_compression_rate: float = 2.0) -> float:
    """Bytes per worker of torch's ``powerSGD_hook`` after ``start_powerSGD_iter`` (before it: dense)."""
    return ring_allreduce_bytes(workers, powersgd_elements(params, rank, shapes, min_compression_rate))


def sparse_message_words(params: int, density: float, fmt: str = "auto") -> int:
    """Words of one gradshare message carrying ``round(density * P)`` entries.

    ``fmt``: "sparse" (5 + count), "bitmap" (5 + ceil(P/16)) or "auto" (the smaller, as encode picks)."""
    if not 0.0 <= density <= 1.0:
        raise ValueError("density must be in [0, 1]")
    count = int(round(density * params))
    sparse = HEADER_WORDS + count
    bitmap = HEADER_WORDS + bitmap_words(params)
    if fmt == "sparse":
        return sparse
    if fmt == "bitmap":
        return bitmap
    if fmt == "auto":
        return min(sparse, bitmap)
    raise ValueError(f"unknown message format {fmt!r}")


def allgather_bytes(workers: int, message_words: int) -> int:
    """Bytes per worker of the padded message all-gather plus the lengths all-gather (varying lengths)."""
    _check(workers, message_words)
    return (workers - 1) * (message_words * WORD_BYTES + LENGTH_BYTES)


def sparse_allgather_bytes(workers: int, params: int, density: float, fmt: str = "auto") -> float:
    """Bytes per worker of gradshare's all-gather exchange, without the dense fallback.

    ``density`` is that of the densest worker (the all-gather pads every row to the longest message)."""
    return allgather_bytes(workers, sparse_message_words(params, density, fmt))


def bitmap_allgather_bytes(workers: int, params: int) -> float:
    """The all-gather when every worker sends a bitmap (density >= 1/16): (N-1)(5 + ceil(P/16)) words."""
    return allgather_bytes(workers, sparse_message_words(params, 1.0, "bitmap"))


def sharing_uses_dense(workers: int, params: int, density: float) -> bool:
    """True where gradshare's exchange falls back to a dense allreduce: N * message_words > 2 P
    (the padded all-gather would move more than the ring allreduce; the rule of gradshare.comm)."""
    return workers > 1 and workers * sparse_message_words(params, density) > 2 * params


def sharing_bytes(workers: int, params: int, density: float) -> float:
    """Bytes per worker of gradshare gradient sharing: the all-gather, or the dense allreduce where cheaper.

    The lengths all-gather always runs (it is how every rank learns the message sizes and decides)."""
    if sharing_uses_dense(workers, params, density):
        return dense_allreduce_bytes(workers, params) + (workers - 1) * LENGTH_BYTES
    return sparse_allgather_bytes(workers, params, density)


@renamed_kwargs(period="frequency")
def averaging_bytes(workers: int, params: int, frequency: int = 5, optimizer_state_factor: float = 0.0) -> float:
    """Amortised bytes per step of averaging parameters (+ optimizer buffers) every ``frequency`` steps."""
    if frequency < 1:
        raise ValueError("frequency must be >= 1")
    return dense_allreduce_bytes(workers, params) * (1.0 + optimizer_state_factor) / frequency


def sharing_crossover_workers(density: float) -> float:
    """Smallest N at which the sparse all-gather moves more than the dense ring allreduce (P large).

    From (N-1) d P > 2 (N-1)/N P: N > 2/d (headers and lengths ignored); 32 for the bitmap (d = 1/16)."""
    if density <= 0:
        return math.inf
    return 2.0 / min(density, 1.0 / 16)


def tensor_parallel_bytes(tp: int, layers: int, batch: int, seq: int, hidden: int, microbatches: int = 1,
                          element_bytes: int = FLOAT16_BYTES) -> float:
    """Bytes per rank per step of Megatron tensor parallelism: 4 ring allreduces of b*s*h per layer."""
    _check(tp, hidden)
    per_layer = 4 * ring_allreduce_bytes(tp, batch * seq * hidden, element_bytes)
    return per_layer * layers * microbatches


def pipeline_parallel_bytes(stages: int, batch: int, seq: int, hidden: int, microbatches: int,
                            element_bytes: int = FLOAT16_BYTES) -> float:
    """Bytes a middle pipeline stage sends per step: activations forward + gradients backward."""
    if stages < 2:
        return 0.0
    return 2.0 * batch * seq * hidden * element_bytes * microbatches


def pipeline_bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of a GPipe/1F1B step: (p-1)/(m+p-1)."""
    return (stages - 1) / (microbatches + stages - 1)


# ------------------------------------------------------------------------------------------ time
def parse_bandwidth(text) -> float:
    """Link speed in bits/s from '100mbit', '1gbit', '10Gbit', '100Mbps', '12.5MB/s' (capital B: bytes) or a number.

    Prefixes k/M/G/T are decimal, as in tc."""
    if isinstance(text, (int, float)):
        return float(text)
    s = str(text).strip().replace(" ", "")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)([kKmMgGtT]?)(bit|bps|b/s|b|Bps|B/s|B)?", s)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"cannot parse bandwidth {text!r} (use e.g. 100mbit, 1gbit, 10gbit)")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2).lower()]
    return value * 8 if (m.group(3) or "").startswith("B") else value


def transfer_time(nbytes: float, bandwidth_bps: float, efficiency: float = LINK_EFFICIENCY) -> float:
    """Seconds to send ``nbytes`` of payload over a link of ``bandwidth_bps`` bits/s."""
    return nbytes * 8.0 / (bandwidth_bps * efficiency)


@dataclass
class Link:
    """A worker's network link: bandwidth (bits/s), per-round latency (s), payload efficiency."""
    bandwidth: float
    latency: float = LATENCY_SECONDS
    efficiency: float = LINK_EFFICIENCY

    def time(self, nbytes: float, rounds: int) -> float:
        return transfer_time(nbytes, self.bandwidth, self.efficiency) + rounds * self.latency

    @classmethod
    def measured(cls, nbytes: float, seconds: float, latency: float) -> "Link":
        """The link a timed collective shows: ``nbytes`` (ring model, per worker) in ``seconds``, of which
        ``latency`` is what a collective of a few bytes took. Payload efficiency 1: the time is the payload's.
        Extrapolating with it (``time(n, rounds=0)``) bounds a larger collective's time from below."""
        if not (nbytes > 0 and seconds >= 0 and latency >= 0):
            raise ValueError(f"Link.measured: expected nbytes > 0 and times >= 0, got {nbytes}, {seconds}, {latency}")
        wire = max(seconds - latency, 1e-9)
        return cls(bandwidth=nbytes * 8.0 / wire, latency=latency, efficiency=1.0)


@dataclass
class SchemeCost:
    """One scheme's bytes and modelled step time for a given setup."""
    name: str
    bytes_per_step: float
    compute: float
    encode: float
    communicate: float
    step_time: float
    note: str = ""
    detail: Dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def _step(name, compute, encode, comm, overlap, nbytes, note="", **detail) -> SchemeCost:
    hidden = min(comm, overlap * compute)
    return SchemeCost(name=name, bytes_per_step=float(nbytes), compute=compute, encode=encode, communicate=comm,
                      step_time=compute + encode + comm - hidden, note=note, detail=detail)


@renamed_kwargs(averaging_period="frequency")
def scheme_costs(params: int, workers: int, link: Link, compute: float, *, density: float = 1e-3,
                 powersgd_rank: int = 2, shapes=None, frequency: int = 5,
                 optimizer_state_factor: float = 0.0, overlap: float = 0.0,
                 encode_per_element: float = ENCODE_SECONDS_PER_ELEMENT,
                 decode_per_word: float = DECODE_SECONDS_PER_WORD,
                 fp16_per_element: float = FP16_SECONDS_PER_ELEMENT,
                 powersgd_per_element: float = POWERSGD_SECONDS_PER_ELEMENT) -> List[SchemeCost]:
    """Modelled cost of every data-parallel scheme for one step of ``compute`` seconds on each worker.

    Returns, in a fixed order: allreduce, fp16, powersgd, sharing (gradshare, with its dense fallback),
    bitmap (gradshare's worst case: every worker at density >= 1/16), averaging (every ``frequency`` steps).
    Encode costs (seconds per element, defaults measured here): fp16 one compress/decompress pass over P;
    PowerSGD its matrix work over the compressed matrices; gradshare one encode pass over P and a decode of
    every received word (a dense pass over P when it falls back to the allreduce)."""
    _check(workers, params)
    n = workers
    out = []
    dense = dense_allreduce_bytes(n, params)
    out.append(_step("allreduce", compute, 0.0, link.time(dense, 2 * (n - 1)), overlap, dense,
                     "DDP default: float32 ring allreduce"))
    fp16 = fp16_allreduce_bytes(n, params)
    enc = 0.0 if n == 1 else params * fp16_per_element
    out.append(_step("fp16", compute, enc, link.time(fp16, 2 * (n - 1)), overlap, fp16,
                     "DDP fp16_compress_hook: 2x fewer bytes"))
    psgd = powersgd_bytes(n, params, powersgd_rank, shapes)
    enc = 0.0 if n == 1 else powersgd_compressed_elements(params, powersgd_rank, shapes) * powersgd_per_element
    out.append(_step("powersgd", compute, enc, link.time(psgd, 4 * (n - 1)), overlap, psgd,
                     f"DDP powerSGD_hook rank {powersgd_rank} (two allreduces: P then Q)"
                     + ("" if shapes is not None else "; no shapes: square-matrix estimate")))
    words = sparse_message_words(params, density)
    gather = sparse_allgather_bytes(n, params, density)
    fallback = sharing_uses_dense(n, params, density)
    share = sharing_bytes(n, params, density)
    if n == 1:
        share_comm, share_enc = 0.0, 0.0
    elif fallback:
        share_comm = link.time(share, 2 * (n - 1) + (n - 1))
        share_enc = params * encode_per_element + params * decode_per_word
    else:
        share_comm = link.time(share, 2 * (n - 1))
        share_enc = params * encode_per_element + n * words * decode_per_word
    out.append(_step("sharing", compute, share_enc, share_comm, 0.0, share,
                     f"gradshare sharing, messages of {density:.3g} of a float32 buffer"
                     + ("; dense fallback (all-gather would move more)" if fallback else "; sparse all-gather"),
                     message_words=words, allgather_bytes=gather, dense_fallback=float(fallback)))
    bwords = sparse_message_words(params, 1.0, "bitmap")
    bmap = (dense + (n - 1) * LENGTH_BYTES if sharing_uses_dense(n, params, 1.0)
            else bitmap_allgather_bytes(n, params))
    out.append(_step("bitmap", compute, 0.0 if n == 1 else params * encode_per_element + n * bwords * decode_per_word,
                     link.time(bmap, 2 * (n - 1)) if n > 1 else 0.0, 0.0, bmap,
                     "gradshare worst case: every worker sends a bitmap (density >= 1/16)"))
    avg = averaging_bytes(n, params, frequency, optimizer_state_factor)
    out.append(_step("averaging", compute, 0.0, link.time(avg * frequency, 2 * (n - 1)) / frequency,
                     0.0, avg, f"parameter averaging every {frequency} steps (amortised)"))
    return out


def speedup(cost: SchemeCost, workers: int) -> float:
    """Throughput of N workers against one worker doing the same per-worker batch: N * compute / step."""
    return workers * cost.compute / cost.step_time if cost.step_time > 0 else float(workers)


def _check(workers: int, elements: int) -> None:
    if workers < 1:
        raise ValueError("workers must be >= 1")
    if elements < 0:
        raise ValueError("element count must be >= 0")


def crossover_table(params: int, densities: Iterable[float], workers: Iterable[int]) -> List[Tuple[float, int, float, float]]:
    """(density, N, all-gather bytes, dense bytes) per worker: the curve of where the all-gather stops paying."""
    return [(d, n, sparse_allgather_bytes(n, params, d), dense_allreduce_bytes(n, params))
            for d in densities for n in workers]
