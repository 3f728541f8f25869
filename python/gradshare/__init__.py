"""gradshare: communication-efficient data-parallel training for PyTorch.

Threshold gradient sharing (Strom 2015) and synchronous parameter averaging, with native kernels.
"""
from gradshare._native import build_info, get_num_threads, set_num_threads
from gradshare.ops import MessageError, NonFiniteError

__version__ = "0.1.0"

__all__ = ["build_info", "get_num_threads", "set_num_threads", "MessageError", "NonFiniteError", "__version__"]
