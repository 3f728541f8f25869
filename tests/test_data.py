import struct
import threading

import numpy as np
import pytest
import torch

from gradshare import data
from gradshare.data import (Prefetcher, batch_indices, eval_shard, load_digits, load_mnist, parse_data_spec,
                            read_idx, train_shard)
from conftest import write_idx


def test_load_digits_shapes_scale_and_split():
    tr, te = load_digits(seed=0)
    x, y = tr.tensors
    assert x.shape[1:] == (1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert len(tr) + len(te) == 1797 and len(te) == 360
    assert float(x.min()) >= 0.0 and float(x.max()) == 1.0
    # stratified: every class is in the test split in about its share
    counts = torch.bincount(te.tensors[1], minlength=10)
    assert int(counts.min()) >= 34 and int(counts.max()) <= 38


def test_load_digits_split_is_fixed_by_seed():
    a, _ = load_digits(seed=0)
    b, _ = load_digits(seed=0)
    c, _ = load_digits(seed=1)
    assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])
    assert not torch.equal(a.tensors[0], c.tensors[0])


@pytest.mark.parametrize("gz", [False, True])
def test_load_mnist_reads_idx_files(tmp_path, gz):
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 7), ("t10k", 3)):
        imgs = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        suffix = ".gz" if gz else ""
        write_idx(tmp_path / f"{split}-images-idx3-ubyte{suffix}", imgs, gz)
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte{suffix}", labels, gz)
        arrays[split] = (imgs, labels)
    tr, te = load_mnist(str(tmp_path))
    assert tr.tensors[0].shape == (7, 1, 28, 28) and te.tensors[0].shape == (3, 1, 28, 28)
    assert torch.allclose(tr.tensors[0][:, 0], torch.from_numpy(arrays["train"][0] / 255.0).float())
    assert torch.equal(te.tensors[1], torch.from_numpy(arrays["t10k"][1].astype(np.int64)))
    tr2, _ = parse_data_spec(f"mnist:{tmp_path}")
    assert torch.equal(tr2.tensors[0], tr.tensors[0])


def test_read_idx_rejects_bad_files(tmp_path):
    p = tmp_path / "bad"
    p.write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(ValueError, match="not an idx file"):
        read_idx(str(p))
    short = tmp_path / "short"
    short.write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 10) + b"\x00" * 4)
    with pytest.raises(ValueError, match="header says"):
        read_idx(str(short))
    with pytest.raises(FileNotFoundError, match="standard MNIST file names"):
        load_mnist(str(tmp_path))


def test_load_real_mnist(mnist_dir):
    tr, te = load_mnist(mnist_dir)
    assert tr.tensors[0].shape == (60000, 1, 28, 28) and te.tensors[0].shape == (10000, 1, 28, 28)
    assert set(torch.unique(te.tensors[1]).tolist()) == set(range(10))


def test_parse_data_spec_errors():
    with pytest.raises(ValueError, match="digits"):
        parse_data_spec("cifar")
    with pytest.raises(ValueError):
        parse_data_spec("mnist:")


@pytest.mark.parametrize("n,world", [(10, 2), (11, 2), (7, 3), (2, 3), (1797, 4)])
def test_train_shard_covers_everything_with_equal_sizes(n, world):
    shards = [train_shard(n, r, world, seed=3, epoch=1) for r in range(world)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) == -(-n // world)
    allidx = torch.cat(shards)
    assert set(allidx.tolist()) == set(range(n))          # nothing skipped
    assert len(allidx) - n < world                        # padding only to equalise
    if n % world == 0:
        assert len(set(allidx.tolist())) == len(allidx)   # disjoint when it divides


def test_train_shard_deterministic_and_changes_per_epoch():
    a = train_shard(100, 1, 2, seed=5, epoch=0)
    assert torch.equal(a, train_shard(100, 1, 2, seed=5, epoch=0))
    assert not torch.equal(a, train_shard(100, 1, 2, seed=5, epoch=1))
    assert not torch.equal(a, train_shard(100, 1, 2, seed=6, epoch=0))


@pytest.mark.parametrize("n,world", [(10, 3), (9, 3), (2, 5), (0, 2), (1001, 4)])
def test_eval_shard_concatenates_to_range(n, world):
    blocks = [eval_shard(n, r, world) for r in range(world)]
    assert [i for b in blocks for i in b] == list(range(n))
    assert max(len(b) for b in blocks) - min(len(b) for b in blocks) <= 1


def test_batch_indices_resume_position():
    b = batch_indices(list(range(10)), 4)
    assert [x.tolist() for x in b] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [x.tolist() for x in batch_indices(list(range(10)), 4, start_batch=2)] == [[8, 9]]


def test_prefetcher_keeps_order_and_raises_producer_errors():
    assert list(Prefetcher(iter(range(50)), buffer=3)) == list(range(50))
    assert list(Prefetcher(iter(range(5)), buffer=0)) == list(range(5))

    def bad():
        yield 1
        raise KeyError("producer failed")

    it = iter(Prefetcher(bad(), buffer=2))
    assert next(it) == 1
    with pytest.raises(KeyError, match="producer failed"):
        next(it)


def test_prefetcher_close_stops_the_thread():
    def endless():
        i = 0
        while True:
            yield i
            i += 1

    p = Prefetcher(endless(), buffer=2)
    it = iter(p)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    p.close()
    assert not p._thread.is_alive()
    assert not any(t.name == "gradshare-prefetch" and t is p._thread for t in threading.enumerate())


def test_batches_from_tensor_dataset_and_generic_dataset():
    x = torch.arange(20.0).view(10, 2)
    y = torch.arange(10)
    ds = torch.utils.data.TensorDataset(x, y)
    got = [b for b in data.batches(ds, [3, 1, 4, 1, 5], 2, prefetch=2)]
    assert [b[1].tolist() for b in got] == [[3, 1], [4, 1], [5]]

    class Plain(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return x[i], y[i]

    got2 = [b for b in data.batches(Plain(), [3, 1, 4], 2, prefetch=0)]
    assert torch.equal(got2[0][0], x[[3, 1]]) and got2[1][1].tolist() == [4]


class _DictSamples(torch.utils.data.Dataset):
    def __init__(self, n=10):
        self.x = torch.arange(n * 3, dtype=torch.float32).view(n, 3)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"image": self.x[i], "label": i % 2}


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([(torch.ones(2, 3) * k, torch.tensor([k, k])) for k in range(3)])


def test_dataloaders_and_ready_made_batches_become_datasets():
    from torch.utils.data import DataLoader

    loader = DataLoader(_DictSamples(), batch_size=4, shuffle=True, collate_fn=lambda s: {"n": len(s)})
    ds = data.as_dataset(loader)
    assert isinstance(ds, data.LoaderDataset) and len(ds) == 10
    assert data.collate(ds, torch.tensor([1, 2])) == {"n": 2}              # the loader's own collate_fn
    plain = data.as_dataset(DataLoader(_DictSamples(), batch_size=4))
    b = data.collate(plain, torch.tensor([3, 4]))                          # dict samples stay a dict batch
    assert torch.equal(b["image"], _DictSamples().x[3:5]) and b["label"].tolist() == [1, 0]
    assert data.split_batch(b, ("image", "label"))[1].tolist() == [1, 0]
    with pytest.raises(KeyError, match="no key 'input' in a batch with keys \\['image', 'label'\\]"):
        data.split_batch(b)

    stream = data.as_dataset(DataLoader(_Stream(), batch_size=None))      # read once into whole batches
    assert isinstance(stream, data.BatchList) and len(stream) == 3
    listed = data.as_dataset([(torch.zeros(2, 3), torch.tensor([0, 1])), (torch.ones(1, 3), torch.tensor([1]))])
    assert isinstance(listed, data.BatchList) and data.samples_per_batch(listed, 32) == 1
    got = [b for b in data.batches(listed, [1, 0], 32, prefetch=0)]
    assert [len(b[1]) for b in got] == [1, 2]                             # each batch as given, whole
    gen = data.as_dataset(((torch.zeros(1, 3), torch.tensor([k])) for k in range(4)))
    assert isinstance(gen, data.BatchList) and len(gen) == 4
    with pytest.raises(TypeError, match="each batch must be a tuple"):
        data.as_dataset(iter([1, 2]))
    with pytest.raises(TypeError, match="a tuple must hold tensors"):
        data.as_dataset([torch.zeros(2), 3])
