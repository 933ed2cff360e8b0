"""Sample ids from the data: `with_sample_ids` gives each item its dataset index, and
`skip_samples` keeps the ids of a skip list out of the data on resume.

loader = DataLoader(ckptlab.with_sample_ids(ds), batch_size=32, num_workers=4)
for ids, batch in loader:
    rec.step(batch, sample_ids=ids)

sampler = ckptlab.skip_samples(RandomSampler(ds), "skip.json")   # from `ckptlab dirty --out`
loader = DataLoader(ckptlab.with_sample_ids(ds), sampler=sampler, batch_size=32)

Where the batch must keep its own shape (a collator that wants dict items, a trainer that
moves `(x, y)` to the device itself), the ids ride elsewhere:

ds = ckptlab.with_sample_ids(tokenized, key="sample_id")   # dict items: the id is one more key
loader = DataLoader(ds, batch_size=32, collate_fn=default_data_collator)
batch = next(iter(loader)); ids = batch.pop("sample_id")

loader = DataLoader(ckptlab.with_sample_ids(ds), collate_fn=ckptlab.collate_with_ids(my_collate))

ids = ckptlab.track_sample_ids(BatchSampler(RandomSampler(ds), 32, drop_last=True))
loader = DataLoader(ds, batch_sampler=ids)      # batches exactly as before
... ids.next_batch() ...                         # the ids of the batch the loop just got
"""

from __future__ import annotations

import operator
import os
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch.utils.data as tud

from ckptlab.run import skiplist


def with_sample_ids(dataset, *, key: str | None = None) -> WithSampleIds:
    """A map-style dataset whose item `i` is `(i, dataset[i])`: a DataLoader over it yields
    `(ids, batch)`, the ids collated into a tensor, whatever the batch's structure (tensors,
    tuples, dicts, nested), sampler (shuffling, DistributedSampler, `skip_samples`) or workers.

        loader = DataLoader(ckptlab.with_sample_ids(ds), batch_size=32, shuffle=True)
        for ids, batch in loader:
            rec.step(batch, sample_ids=ids)

    `key="sample_id"`: for a dataset of dict items (tokenized text), item `i` is the item with
    one more key, `key: i`, so a collator that wants dict items (transformers'
    `default_data_collator`, `DataCollatorWithPadding`) collates the ids with the rest;
    `ids = batch.pop("sample_id")` takes them out before the model sees the batch. Another
    collator over `(id, item)` pairs: `collate_with_ids(collate_fn)`.

    The id is the item's index in the dataset underneath any `torch.utils.data.Subset`s (so
    also under `skip_samples(dataset, ...)`): the id `ckptlab dirty` and `skip_samples` use.
    """
    if not _is_map_dataset(dataset):
        raise TypeError(
            f"with_sample_ids needs a map-style dataset (__getitem__ and __len__), not {type(dataset).__name__}"
        )
    return WithSampleIds(dataset, key)


class WithSampleIds(tud.Dataset):
    """`dataset` with each item's id: item i is (id, dataset[i]), or with `key` the dict item
    with the id under `key`. See `with_sample_ids`."""

    def __init__(self, dataset, key: str | None = None):
        self.dataset, self.key = dataset, key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        item = self.dataset[i]
        if self.key is None:
            return sample_id(self.dataset, i), item
        if not isinstance(item, Mapping):
            raise TypeError(
                f"with_sample_ids(..., key={self.key!r}) needs dict items, but item {i} is a {type(item).__name__} "
                "(without key=, items are (id, item) pairs)"
            )
        if self.key in item:
            raise ValueError(f"item {i} already has a {self.key!r} key: pass another key= to with_sample_ids")
        return {**item, self.key: sample_id(self.dataset, i)}


def collate_with_ids(collate_fn: Callable[[list], Any] | None = None) -> Callable[[list], tuple]:
    """A DataLoader `collate_fn` for `with_sample_ids` items, `(id, item)`: returns
    `(ids, collate_fn(items))`, the ids as a tensor and the items collated by your collator
    (default: torch's `default_collate`), which never sees the ids.

        loader = DataLoader(ckptlab.with_sample_ids(ds), batch_size=8,
                            collate_fn=ckptlab.collate_with_ids(default_data_collator))
        for ids, batch in loader: ...
    """
    inner = collate_fn if collate_fn is not None else tud.default_collate

    def collate(pairs: list) -> tuple:
        return tud.default_collate([i for i, _ in pairs]), inner([item for _, item in pairs])

    return collate


def track_sample_ids(batch_sampler) -> SampleIdTracker:
    """A batch sampler that remembers the ids of the batches it hands out, for a loop that
    cannot take ids in the batch (a trainer that moves `(x, y)` to the device itself): pass it
    as the DataLoader's `batch_sampler`; the batches are exactly as before, and after the loop
    takes a batch, `next_batch()` is that batch's ids (dataset indices, as `with_sample_ids`'s).

        ids = ckptlab.track_sample_ids(BatchSampler(RandomSampler(ds), 32, drop_last=False))
        loader = DataLoader(ds, batch_sampler=ids, num_workers=4)
        for x, y in loader:
            rec.step((x, y), sample_ids=ids.next_batch())

    Batches come out of a DataLoader in the order the batch sampler made them (workers and
    prefetching included), so the ids line up; a new epoch (a new iterator) starts afresh.
    A `skip_samples` batch sampler can be tracked too."""
    return SampleIdTracker(batch_sampler)


class SampleIdTracker(tud.Sampler):
    """See `track_sample_ids`."""

    def __init__(self, batch_sampler) -> None:
        self.batch_sampler = batch_sampler
        self._pending: deque[list] = deque()

    def __iter__(self):
        self._pending.clear()  # a new epoch: what an abandoned iterator made is gone
        for batch in self.batch_sampler:
            batch = list(batch)
            self._pending.append(batch)
            yield batch

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def next_batch(self) -> list:
        """The ids of the next batch the loop received (call once per batch, in order)."""
        if not self._pending:
            raise RuntimeError("track_sample_ids: next_batch() called more often than the loader gave batches")
        return self._pending.popleft()

    def set_epoch(self, epoch: int) -> None:
        for inner in (self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            set_epoch = getattr(inner, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(epoch)
                return


def sample_id(dataset, i):
    """Index `i` of `dataset`, as an index of the dataset underneath its Subsets (a key that is
    not a position, from a custom sampler, is its own id)."""
    try:
        i = operator.index(i)
    except TypeError:
        return i
    while isinstance(dataset, tud.Subset):
        dataset, i = dataset.dataset, int(dataset.indices[i])
    return i


def skip_samples(source, skip, *, key: Callable[[Any], Any] | None = None):
    """Wrap a sampler, batch sampler, dataset or any iterable so that the sample ids in `skip`
    never come out of it.

        sampler = ckptlab.skip_samples(RandomSampler(ds), "skip.json")
        loader = DataLoader(ds, sampler=sampler, batch_size=32)

    `skip` is a skip-list file (`ckptlab dirty --out skip.json`), a DirtyReport, or ids.
    - A sampler (yields dataset indices, which is what a DataLoader records as sample ids when
      you pass the indices): yields every index not in `skip`.
    - A batch sampler (yields lists of indices): drops those indices from each batch, and a
      batch left empty.
    - A map-style dataset (`__getitem__` + `__len__`): a `torch.utils.data.Subset` without the
      skipped indices (positions shift: prefer wrapping the sampler).
    - Any other iterable (an IterableDataset, a generator): yields items whose id is not in
      `skip`; the id is `key(item)`, else the item itself.
    """
    ids = _skip_set(skip)
    if _is_map_dataset(source):
        keep = [i for i in range(len(source)) if not _member(i, ids)]
        return tud.Subset(source, keep)
    return _SkipIterable(source, ids, key)


def _skip_set(skip) -> frozenset:
    if hasattr(skip, "skip_ids"):  # a DirtyReport
        values = skip.skip_ids
    elif isinstance(skip, (str, os.PathLike)):
        values = skiplist.read(skip)
    else:
        values = list(skip)
    return frozenset(_norm_id(v) for v in values)


def _norm_id(v):
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        v = v.item()
    return v


def _member(v, ids: frozenset) -> bool:
    try:
        return _norm_id(v) in ids
    except TypeError:  # unhashable item without a key: never skipped
        return False


def _is_map_dataset(source) -> bool:
    if isinstance(source, (tud.Sampler, tud.IterableDataset)):
        return False
    return (
        hasattr(source, "__getitem__")
        and hasattr(source, "__len__")
        and not isinstance(source, (list, tuple, range, str))
    )


class _SkipIterable(tud.Sampler):
    """Filters what the wrapped sampler/iterable yields (see `skip_samples`)."""

    def __init__(self, source: Iterable, ids: frozenset, key: Callable | None):
        self.source, self.ids, self.key = source, ids, key

    def __iter__(self):
        for item in self.source:
            if self.key is not None:
                if not _member(self.key(item), self.ids):
                    yield item
            elif isinstance(item, (list, tuple)) and not hasattr(item, "_fields"):
                kept = [i for i in item if not _member(i, self.ids)]
                if kept:
                    yield type(item)(kept) if isinstance(item, tuple) else kept
            elif not _member(item, self.ids):
                yield item

    def __len__(self):
        """For a sampler of indices 0..n-1: n minus the skipped ids in that range (a
        DataLoader only uses it for len(loader)); batch samplers keep their length."""
        n = len(self.source)
        if self.key is not None:
            return n
        inner = getattr(self.source, "sampler", None)  # a BatchSampler
        if inner is not None:
            return n
        return n - sum(1 for i in self.ids if isinstance(i, int) and 0 <= i < n)

    def set_epoch(self, epoch: int) -> None:  # DistributedSampler's hook passes through
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)
