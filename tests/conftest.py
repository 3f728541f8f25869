"""What several test files share: the MNIST files' place, MNIST-shaped idx files, a process group of one.

Functions that a spawned worker runs stay in importable modules (tiny_model.py, cluster_job.py): a worker
imports the test module it runs, never a fixture.
"""
import gzip
import os
import struct

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# The real MNIST idx files (gzipped), where this machine has them: beside the checkout, in shared/data/mnist.
MNIST_DIR = os.path.join(HERE, "..", "..", "shared", "data", "mnist")
MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
               "t10k-labels-idx1-ubyte.gz")


def have_mnist() -> bool:
    """True when all four MNIST files are in MNIST_DIR."""
    return all(os.path.exists(os.path.join(MNIST_DIR, name)) for name in MNIST_FILES)


def write_idx(path, arr: np.ndarray, gz: bool = True) -> None:
    """Writes a uint8 array as an idx file (the MNIST format), gzipped or not."""
    head = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    with (gzip.open if gz else open)(path, "wb") as f:
        f.write(head + arr.astype(np.uint8).tobytes())


@pytest.fixture
def mnist_dir() -> str:
    """The real MNIST folder; the test is skipped where this machine has none."""
    if not have_mnist():
        pytest.skip(f"no MNIST files in {MNIST_DIR}")
    return MNIST_DIR


@pytest.fixture
def tiny_mnist(tmp_path):
    """A folder of MNIST-format files a model learns in a few steps (96 train and 40 test images, a bright
    row per class)."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 96), ("t10k", 40)):
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        images = np.zeros((n, 28, 28), dtype=np.uint8)
        for i, c in enumerate(labels):
            images[i, 2 + 2 * c, :] = 255
        write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", images)
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", labels)
    return tmp_path


@pytest.fixture
def world_of_one(monkeypatch):
    """No launcher's environment, so that gradshare.cluster.run makes a one-process group on loopback in this
    process (its store on a port the system picks); what it sets is undone after the test."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.setenv(name, "")          # recorded, so that the test's own settings are undone too
        monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _deprecations_warn_afresh():
    """A former name warns once per process (gradshare._deprecation): every test sees its first use again."""
    from gradshare import _deprecation

    _deprecation._warned.clear()
    yield
