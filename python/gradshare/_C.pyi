"""Type stubs for gradshare's native library (csrc/bindings.cpp): a raw-pointer API; use gradshare.ops.

Pointers are ``tensor.data_ptr()`` values; ``dtype`` codes and message formats are gradshare.ops's and
gradshare.message's constants; ``stream`` is a CUDA stream handle (0 on CPU).
"""
from typing import Dict, List, Tuple, Union

HEADER_WORDS: int
MAGIC_VERSION: int

class MessageError(ValueError): ...

def count(update: int, dtype: int, residual: int, n: int, tau: float, cuda: bool, stream: int) -> Tuple[int, int]:
    """(entries whose |residual + update| >= tau, first non-finite index or -1)."""

def encode(update: int, dtype: int, residual: int, kept: int, n: int, tau: float, clip: float, choice: int, out: int,
           capacity: int, cuda: bool, stream: int, velocity: int = 0, momentum: float = 0.0,
           velocity_out: int = 0) -> Tuple[int, int, int, int]:
    """Strom +-tau encoding of residual + update, what is not sent written to kept (the residual itself, or a
    buffer apart from it): (message words, entries, first non-finite index, format). With velocity != 0 the
    update's place is taken by momentum * velocity + update, written to velocity_out with the sent entries 0."""

def encode_chunked(format: int, update: int, dtype: int, residual: int, kept: int, n: int, chunk: int, param: float,
                   out: int, capacity: int, cuda: bool, stream: int, velocity: int = 0, momentum: float = 0.0,
                   velocity_out: int = 0) -> Tuple[int, int, int]:
    """Top-k or ternary per chunk of residual + update, what is not sent written to kept: (message words,
    entries, first non-finite index). On CUDA the call does not wait for the device: the index is -1 and a
    ternary message's entries -1 (its header holds both). velocity, momentum, velocity_out: as for encode."""

def decode(dst: int, n: int, msgs: int, num_msgs: int, row_words: int, scale: float, cuda: bool, stream: int) -> None:
    """Adds scale * each message row into dst (bounds-checked; raises MessageError on a bad message)."""

def average(dst: int, srcs: List[int], weights: List[float], n: int, cuda: bool, stream: int) -> None:
    """dst = sum of weights[i] * srcs[i] (equal weights when empty)."""

def rescale(exp_avg: int, exp_avg_sq: int, change: int, after: int, signal: int, target: int, n: int, bias1: float,
            bias2: float, world: float, eps: float, lr: float, decay: float, sign: float, signal_weight: float,
            signal_bias: float, cuda: bool, stream: int) -> None:
    """target += sign * the excess of the global batch's step over a rank's own (Adam form when change is 0,
    else the change form; after is read only when decay != 0); signal (0: none) is gradshare's average of m^2,
    updated with signal_weight and read divided by signal_bias."""

def rescale_many(ptrs: List[int], ns: List[int], scalars: List[float], cuda: bool, stream: int) -> None:
    """rescale for each item in turn: ptrs holds 6 addresses per item (exp_avg, exp_avg_sq, change, after, signal,
    target), ns its element count, scalars 9 floats per item in rescale's order (bias1 ... signal_bias)."""

def scale_into(dsts: List[int], srcs: List[int], ns: List[int], scale: float) -> bool:
    """dsts[j][i] = srcs[j][i] * scale (float32, ns[j] each, CPU); whether any value written is NaN or Inf."""

def rescale_tracked(kind: int, grad: int, change: int, after: int, second: int, grad_avg: int, mean: int, extra: int,
                    signal: int, target: int, n: int, world: float, inv_world: float, grad_sign: float,
                    weight_decay: float, decay: float, mean_weight: float, mean_bias: float, offset: float,
                    scale: float, count: float, eps: float, momentum: float, lr: float, square_weight: float,
                    square_bias: float, sign: float, signal_weight: float, signal_bias: float, cuda: bool,
                    stream: int) -> None:
    """target += sign * the excess of the global batch's step for an optimizer whose mean gradient gradshare
    keeps (kind: 0 RMSprop, 1 Adagrad, 2 Adadelta, 3 Adamax, 4 Adafactor); updates mean and extra, and signal
    (0: none), the average of m^2 over the second moment's window (signal_weight, read over signal_bias)."""

def build_info() -> Dict[str, Union[bool, int, str]]: ...
def cpu_threads() -> int: ...
def set_cpu_threads(threads: int) -> None: ...
