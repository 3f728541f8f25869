"""gradshare: communication-efficient data-parallel training for PyTorch.

Threshold gradient sharing (Strom 2015) and synchronous parameter averaging, with native kernels.
"""
from gradshare._native import build_info, get_num_threads, set_num_threads
from gradshare.ops import MessageError, NonFiniteError
from gradshare.thresholds import Adaptive, Fixed, ResidualClipping, TargetSparsity
from gradshare.compression import Dense, Strom, Ternary, TopK
from gradshare.stats import Statistics
from gradshare.link import LinkAware
from gradshare.comm import ExchangeAbortedError, NonFiniteStepError, exchange, exchange_async
from gradshare.sharing import ConfigurationMismatchError
from gradshare.hooks import ThresholdState, threshold_hook
from gradshare.optim import SharedOptimizer
from gradshare.replicas import ReplicaMismatchError, verify_replicas
from gradshare.averaging import ParameterAveraging
from gradshare.models import SmallCNN
from gradshare.parallel import ParallelWrapper

__version__ = "0.1.0"

__all__ = ["build_info", "get_num_threads", "set_num_threads", "MessageError", "NonFiniteError", "__version__",
           "Adaptive", "Fixed", "ResidualClipping", "TargetSparsity", "TopK", "Ternary", "Strom", "Dense", "LinkAware", "Statistics", "NonFiniteStepError",
           "ExchangeAbortedError", "ConfigurationMismatchError", "exchange", "exchange_async", "ThresholdState", "threshold_hook", "SharedOptimizer",
           "ReplicaMismatchError", "verify_replicas", "ParameterAveraging", "SmallCNN", "ParallelWrapper"]
