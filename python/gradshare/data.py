"""Datasets that ship offline, MNIST idx files, and deterministic per-worker sharding with prefetching.

Use :func:`parse_data_spec` to turn a command-line dataset name into (train, test) datasets,
:func:`train_shard` / :func:`eval_shard` to split a dataset between data-parallel ranks, and
:class:`Prefetcher` to build the next batches in a background thread while the current one trains.
"""
from __future__ import annotations

import gzip
import os
import queue
import struct
import threading
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

DataLike = Union[Dataset, Tuple[torch.Tensor, ...], str]


# --------------------------------------------------------------------------------------------- datasets
def load_digits(seed: int = 0, test_fraction: float = 0.2) -> Tuple[TensorDataset, TensorDataset]:
    """scikit-learn's bundled handwritten digits (1797 images, 8x8, 10 classes): (train, test).

    Pixels are scaled to [0, 1], images shaped (N, 1, 8, 8) float32, labels int64. The split is stratified
    by class and fixed by ``seed`` (the same seed always gives the same split).
    """
    from sklearn.datasets import load_digits as _sk_digits
    from sklearn.model_selection import train_test_split

    d = _sk_digits()
    x = (d.images.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    return (TensorDataset(torch.from_numpy(xtr), torch.from_numpy(ytr)),
            TensorDataset(torch.from_numpy(xte), torch.from_numpy(yte)))


_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str) -> np.ndarray:
    """Reads one idx file (the MNIST format), gzipped (by magic bytes, whatever the name) or not."""
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an idx file (bad magic {raw[:4].hex()})")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = int(np.prod(dims)) * dtype.itemsize
    body = raw[4 + 4 * ndim:]
    if len(body) != expected:
        raise ValueError(f"{path}: header says {dims} ({expected} bytes of data) but the file holds {len(body)}")
    return np.frombuffer(body, dtype=dtype).reshape(dims)


MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def find_idx(folder: str, stem: str) -> str:
    # Standard names, gzipped or not; some mirrors write "train-images.idx3-ubyte".
    alt = stem.replace("-idx", ".idx")
    for name in (stem, stem + ".gz", alt, alt + ".gz"):
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            return p
    raise FileNotFoundError(f"{folder}: no {stem} or {stem}.gz (the standard MNIST file names)")


def load_mnist(path: str) -> Tuple[TensorDataset, TensorDataset]:
    """MNIST from the four standard idx files in folder ``path`` (gzipped or not): (train, test).

    Images (N, 1, 28, 28) float32 scaled to [0, 1], labels int64.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a folder (expected one holding the MNIST idx files)")
    out = []
    for split in ("train", "t10k"):
        images = read_idx(find_idx(path, f"{split}-images-idx3-ubyte"))
        labels = read_idx(find_idx(path, f"{split}-labels-idx1-ubyte"))
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ValueError(f"{path}: {split} images {images.shape} and labels {labels.shape} do not match")
        x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
        out.append(TensorDataset(x, torch.from_numpy(labels.astype(np.int64))))
    return out[0], out[1]


def parse_data_spec(spec: str, seed: int = 0) -> Tuple[TensorDataset, TensorDataset]:
    """``"digits"`` -> :func:`load_digits` (split by ``seed``); ``"mnist:PATH"`` -> :func:`load_mnist`."""
    if spec == "digits":
        return load_digits(seed=seed)
    if spec.startswith("mnist:") and len(spec) > len("mnist:"):
        return load_mnist(os.path.expanduser(spec[len("mnist:"):]))
    raise ValueError(f"data: expected 'digits' or 'mnist:PATH', got {spec!r}")


class LoaderDataset(Dataset):
    """A DataLoader's map-style dataset with its ``collate_fn``: batches are built as the loader builds
    them (dict batches too), from the indices gradshare deals to each rank (the loader's own sampler and
    shuffling give way to that, as DistributedSampler's do)."""

    def __init__(self, dataset: Dataset, collate_fn):
        self.dataset, self.collate_fn = dataset, collate_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i]


class BatchList(Dataset):
    """Batches given ready-made (a list of them, or read once from an iterable): each item is one batch,
    dealt whole to a rank (batch size 1 of this dataset)."""

    def __init__(self, batches: Sequence):
        self.batches = list(batches)
        if not self.batches:
            raise ValueError("data: no batches")
        kinds = {type(b).__name__ for b in self.batches if not isinstance(b, (tuple, list, dict))}
        if kinds:
            raise TypeError(f"data: each batch must be a tuple (inputs, targets, ...) or a dict, got {sorted(kinds)}")

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]

    @staticmethod
    def collate_fn(items):
        return items[0]


def as_dataset(data: DataLike, split: str = "train", seed: int = 0) -> Dataset:
    """A Dataset from a Dataset, a tuple of tensors (inputs, targets, ...), a data spec string, a DataLoader
    (:class:`LoaderDataset`; one over an IterableDataset is read once into a :class:`BatchList`), a list of
    batches or any other finite iterable of batches (read once, :class:`BatchList`)."""
    from torch.utils.data import DataLoader, IterableDataset

    if isinstance(data, str):
        train, test = parse_data_spec(data, seed=seed)
        return train if split == "train" else test
    if isinstance(data, DataLoader):
        if isinstance(data.dataset, IterableDataset):
            return BatchList(data)
        return LoaderDataset(data.dataset, data.collate_fn)
    if isinstance(data, (tuple, list)):
        if data and all(isinstance(t, torch.Tensor) for t in data):
            return TensorDataset(*data)
        if data and all(isinstance(b, (tuple, list, dict)) for b in data):
            return BatchList(data)
        raise TypeError("data: a tuple must hold tensors (inputs, targets, ...), a list batches (tuples or "
                        "dicts); convert arrays with torch.as_tensor")
    if isinstance(data, Dataset) and not isinstance(data, IterableDataset) or (
            hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        return data
    if isinstance(data, IterableDataset) or hasattr(data, "__iter__"):
        return BatchList(data)
    raise TypeError(f"data: expected a Dataset, a DataLoader, batches, a tuple of tensors or a spec string, got "
                    f"{type(data).__name__}")


def split_batch(batch, keys: Tuple[str, str] = ("input", "target")):
    """(inputs, targets) of a batch: a tuple (inputs, targets, ...) or a dict, read at ``keys``."""
    if isinstance(batch, dict):
        missing = [k for k in keys if k not in batch]
        if missing:
            raise KeyError(f"batch: no key {missing[0]!r} in a batch with keys {sorted(map(str, batch))}; name the "
                           "inputs and targets with batch_keys=(inputs, targets)")
        return batch[keys[0]], batch[keys[1]]
    if len(batch) < 2:
        raise ValueError(f"batch: expected (inputs, targets, ...), got {len(batch)} element(s)")
    return batch[0], batch[1]


def to_device(batch, device: torch.device):
    """A tuple or dict batch with its tensors on ``device`` (other values as they are)."""
    move = lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t  # noqa: E731
    if isinstance(batch, dict):
        return {k: move(v) for k, v in batch.items()}
    return tuple(move(t) for t in batch)


def image_shape(ds: Dataset) -> Tuple[int, ...]:
    """Shape of one input sample (without the batch dimension)."""
    if isinstance(ds, TensorDataset):
        return tuple(ds.tensors[0].shape[1:])
    return tuple(torch.as_tensor(ds[0][0]).shape)


# --------------------------------------------------------------------------------------------- sharding
def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The same shuffled order of range(n) on every rank for (seed, epoch)."""
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + int(epoch)) % (2 ** 63))
    return torch.randperm(n, generator=g)


def train_shard(n: int, rank: int, world_size: int, seed: int = 0, epoch: int = 0,
                shuffle: bool = True) -> torch.Tensor:
    """Indices rank ``rank`` trains on in ``epoch``: every rank gets ceil(n / world_size) of them.

    The epoch's permutation (same on every rank) is dealt round-robin. When n does not divide, the first
    samples of the permutation are reused to pad (as DistributedSampler does), so every rank runs the
    same number of steps and none waits on a collective the others never reach; no sample is skipped.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: {rank} not in [0, {world_size})")
    if n < 1:
        raise ValueError("dataset is empty")
    order = epoch_permutation(n, seed, epoch) if shuffle else torch.arange(n)
    per_rank = -(-n // world_size)
    total = per_rank * world_size
    if total > n:
        order = torch.cat([order, order[: total - n].repeat(-(-(total - n) // n))[: total - n]])
    return order[rank:total:world_size]


def eval_shard(n: int, rank: int, world_size: int) -> range:
    """A contiguous block of range(n) for rank ``rank``; blocks differ in size by at most one and,
    concatenated in rank order, are exactly range(n) (nothing dropped or duplicated)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: {rank} not in [0, {world_size})")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def batch_indices(indices: Sequence[int], batch_size: int, start_batch: int = 0) -> List[torch.Tensor]:
    """``indices`` cut into batches of ``batch_size`` (the last may be smaller), from ``start_batch``."""
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    idx = torch.as_tensor(indices, dtype=torch.long)
    return list(torch.split(idx, batch_size))[start_batch:]


def collate(ds: Dataset, idx: torch.Tensor):
    """The samples ``idx`` of ``ds`` as one batch: a dict when the samples are dicts, else a tuple; built
    by the dataset's ``collate_fn`` when it has one (:class:`LoaderDataset`, :class:`BatchList`); fast path
    for TensorDataset."""
    if isinstance(ds, TensorDataset):
        return tuple(t[idx] for t in ds.tensors)
    from torch.utils.data import default_collate

    b = getattr(ds, "collate_fn", default_collate)([ds[int(i)] for i in idx])
    return b if isinstance(b, dict) else tuple(b)


# ------------------------------------------------------------------------------------------- prefetching
_DONE = object()


class Prefetcher:
    """Iterates ``source`` in a background thread, keeping up to ``buffer`` items ready.

    Use it around batch building (indexing, collation, host-to-device copies) so the next batches are
    prepared while the current one trains. ``buffer=0`` iterates in the calling thread. An exception in
    the producer is raised in the consumer; :meth:`close` (or leaving a ``with`` block) stops the thread.
    """

    def __init__(self, source: Iterable, buffer: int = 2):
        self._source = source
        self._buffer = int(buffer)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if self._buffer > 0:
            self._queue: "queue.Queue" = queue.Queue(maxsize=self._buffer)
            self._thread = threading.Thread(target=self._produce, name="gradshare-prefetch", daemon=True)
            self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for item in self._source:
                if not self._put((True, item)):
                    return
        except BaseException as exc:  # handed to the consumer
            self._put((False, exc))
            return
        self._put((True, _DONE))

    def __iter__(self) -> Iterator:
        if self._thread is None:
            yield from self._source
            return
        while True:
            ok, item = self._queue.get()
            if not ok:
                raise item
            if item is _DONE:
                return
            yield item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def samples_per_batch(ds: Dataset, batch_size: int) -> int:
    """``batch_size``, or 1 for a :class:`BatchList` (its items are the batches, used as given)."""
    return 1 if isinstance(ds, BatchList) else int(batch_size)


def batches(ds: Dataset, indices: Sequence[int], batch_size: int, *, start_batch: int = 0,
            device: Optional[torch.device] = None, prefetch: int = 2) -> Prefetcher:
    """Batches of ``ds`` over ``indices`` (from ``start_batch``), built ``prefetch`` ahead in a thread."""
    chunks = batch_indices(indices, samples_per_batch(ds, batch_size), start_batch)

    def gen():
        for idx in chunks:
            b = collate(ds, idx)
            if device is not None and device.type != "cpu":
                b = to_device(b, device)
            yield b

    return Prefetcher(gen(), prefetch)
