"""Training data for spes: token shards on disk, fixed-length windows over them, and a resumable loader.

`data_process_scripts/tokenize_data.py` writes flat 1-D `.npy` token shards, each with a JSON
sidecar `<shard>.npy.json` written last; headerless OLMo-format token files without a sidecar are
read too (see `spes.shards`). The trainer reads them as

    shards = resolve_paths(cfg.data.paths, ranged=cfg.data.url_reads == "range")
    ds = TokenSequenceDataset(shards, cfg.model.max_sequence_length, cfg.data.memmap_dtype)
    loader = BatchLoader(ds, batch_size=cfg.global_train_batch_size, seed=cfg.data_seed, rank=r, world_size=w)
    batch = next(loader)  # LongTensor (global_batch // world_size, seq_len), this rank's slice

Each node passes its own seed (`cfg.data_seed`: its `data.seed`, as the first implementation's node files give
6198, 7198, ...), so nodes see the data in different orders; epoch `e` is read in the first implementation's
(OLMo's) order for seed `s` (`olmo_order`). A loader's `state_dict()` is a few integers, enough to resume
mid-epoch without reading skipped data.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import os
import posixpath
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from spes.remote_files import is_url
from spes.shards import (
    RangeTokenArray,
    Shard,
    ShardInfo,
    check_shard_name,
    find_shard_info,
    open_token_array,
)

TokenArray = np.ndarray | RangeTokenArray
OPEN_THREADS = 16
"""Shards opened at once: a shard at a URL costs a round trip or two to open, and a list may name thousands."""

log = logging.getLogger(__name__)

ORDER = "olmo"
"""The data-order rule of the states this loader writes; a state without one was written by an earlier spes,
whose epochs were `numpy.random.default_rng([seed, epoch]).permutation(N)` (still followed, so it resumes exactly)."""


def olmo_order(seed: int, epoch: int, num_windows: int) -> np.ndarray:
    """The windows of epoch `epoch` in the first implementation's (OLMo's) order: 0..N-1 shuffled by a PCG64
    generator seeded with `seed + epoch`. With the same shards, window length and seed, a node reads the same
    windows in the same order as there (global batch k = positions [k*B, (k+1)*B) of it)."""
    return np.random.Generator(np.random.PCG64(seed + epoch)).permutation(num_windows)


def check_shard_array(path: Shard, array: TokenArray, info: ShardInfo | None, want_dtype: np.dtype | None) -> None:
    """ValueError unless the shard at `path` is a 1-D array of unsigned token ids that matches its sidecar `info`
    (if any) and `want_dtype` (`data.memmap_dtype`, if set)."""
    if info is not None and (array.ndim != 1 or array.dtype != np.dtype(info.dtype) or len(array) != info.num_tokens):
        raise ValueError(
            f"token shard {path} does not match its sidecar (array {array.dtype} {array.shape}, sidecar "
            f"{info.dtype} ({info.num_tokens},)); rerun tokenize_data.py for it"
        )
    if array.ndim != 1:
        raise ValueError(f"token shard {path} holds a {array.ndim}-D array; token shards are 1-D")
    if array.dtype.kind != "u":
        raise ValueError(f"token shard {path} holds {array.dtype} values; token ids are unsigned (uint16, uint32)")
    if want_dtype is not None and array.dtype != want_dtype:
        raise ValueError(
            f"token shard {path} holds {array.dtype} tokens but data.memmap_dtype is {want_dtype}; "
            f"set data.memmap_dtype={array.dtype} or leave it unset to use the shards' dtype"
        )


def check_eos(paths: Sequence[Shard], infos: Sequence[ShardInfo | None], eos_token_id: int) -> None:
    """ValueError naming the first shard whose sidecar records another EOS than `eos_token_id` (`model.eos_token_id`:
    what an exported model stops at, so it must be the token that ended the documents it learned from)."""
    for path, info in zip(paths, infos):
        if info is not None and info.eos_token_id != eos_token_id:  # NOTE: a bare OLMo file records none
            raise ValueError(
                f"token shard {path} ends its documents with token {info.eos_token_id} but model.eos_token_id is "
                f"{eos_token_id}; set model.eos_token_id={info.eos_token_id} (its tokenizer's EOS) or re-tokenize it"
            )


def common_fingerprint(paths: Sequence[Shard], infos: Sequence[ShardInfo | None]) -> str | None:
    """The one tokenizer fingerprint the shards' sidecars record (None without sidecars); ValueError naming two
    shards of different tokenizers."""
    known = [(p, i) for p, i in zip(paths, infos) if i is not None]
    if not known:
        return None
    first_path, first = known[0]
    odd = next((p for p, i in known if i.tokenizer_fingerprint != first.tokenizer_fingerprint), None)
    if odd is not None:
        raise ValueError(
            f"token shards were made with different tokenizers: {first_path} and {odd}; "
            f"tokenize all data with the same tokenizer"
        )
    return first.tokenizer_fingerprint


class TokenSequenceDataset:
    """Fixed-length windows of `seq_len` tokens over memory-mapped token shards.

    Window `i` is a contiguous slice of one shard; windows never cross a shard's end and each
    shard's last `num_tokens % seq_len` tokens are dropped. Local shards are mapped again in each process
    (so DataLoader workers map them themselves instead of receiving copies); a shard at a URL travels as its URL
    and layout, read by byte ranges. With `vocab_size`, a window holding a larger token id is refused as it is read
    (a shard of another tokenizer; OLMo's bare files name none).
    """

    def __init__(
        self,
        paths: Sequence[Shard | os.PathLike[str]],
        seq_len: int,
        memmap_dtype: str | None = None,
        *,
        vocab_size: int | None = None,
    ):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not paths:
            raise ValueError("TokenSequenceDataset needs at least one token shard")
        self.seq_len, self.vocab_size = seq_len, vocab_size
        self.paths: list[Shard] = [p if isinstance(p, str) and is_url(p) else Path(p) for p in paths]
        for path in self.paths:
            check_shard_name(path)
        want_dtype = np.dtype(memmap_dtype) if memmap_dtype is not None else None
        self.memmap_dtype = memmap_dtype
        with ThreadPoolExecutor(min(OPEN_THREADS, len(self.paths))) as pool:
            self.shard_infos = list(pool.map(find_shard_info, self.paths))
            self._arrays: list[TokenArray | None] = list(pool.map(self._open, self.paths))
        lengths = []
        for path, info, array in zip(self.paths, self.shard_infos, self._arrays):
            assert array is not None
            check_shard_array(path, array, info, want_dtype)
            lengths.append(len(array))
        bare = [i for i, info in enumerate(self.shard_infos) if info is None]
        if bare:
            more = f" (and {len(bare) - 1} more)" if len(bare) > 1 else ""
            log.warning(
                f"note: token shard {self.paths[bare[0]]}{more} has no .npy.json sidecar (an OLMo-style "
                f"file): read as {self.shard_array(bare[0]).dtype} tokens; its tokenizer cannot be checked"
            )
        self.fingerprint = common_fingerprint(self.paths, self.shard_infos)
        """The tokenizer fingerprint the sidecars record; None when no shard has a sidecar."""
        self.num_tokens = int(sum(lengths))
        # window_starts[k] = index of shard k's first window; the last entry is the window count.
        self._window_starts = np.concatenate([[0], np.cumsum([n // seq_len for n in lengths])]).astype(np.int64)

    def layout(self) -> str:
        """A digest of the shards in their order, by file name and window count: what a data position is a place in,
        whatever directory or URL they are read from (the window count alone missed reordered data.paths)."""
        digest = hashlib.sha256()
        for i, path in enumerate(self.paths):
            digest.update(f"{posixpath.basename(str(path))}\t{len(self.shard_windows(i))}\n".encode())
        return digest.hexdigest()[:16]

    def _open(self, path: Shard) -> TokenArray:
        return open_token_array(path, self.memmap_dtype)

    def shard_array(self, index: int) -> TokenArray:
        """The tokens of shard `index` (opened again in a new process)."""
        array = self._arrays[index]
        if array is None:
            array = self._arrays[index] = self._open(self.paths[index])
        return array

    def shard_windows(self, index: int) -> range:
        """The windows that lie in shard `index`."""
        return range(int(self._window_starts[index]), int(self._window_starts[index + 1]))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_arrays"] = [a if isinstance(a, RangeTokenArray) else None for a in self._arrays]
        return state

    def __len__(self) -> int:
        return int(self._window_starts[-1])

    def _window(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"window {i} out of range for a dataset of {len(self)} windows")
        i %= len(self)
        shard = int(np.searchsorted(self._window_starts, i, side="right")) - 1
        start = (i - int(self._window_starts[shard])) * self.seq_len
        window = self.shard_array(shard)[start : start + self.seq_len]
        if self.vocab_size is not None and int(window.max()) >= self.vocab_size:
            raise ValueError(
                f"token shard {self.paths[shard]} holds token id {int(window.max())} (in tokens {start}.."
                f"{start + self.seq_len - 1}), past model.vocab_size={self.vocab_size}: it was tokenized with "
                "another tokenizer; retokenize it or leave it out of data.paths"
            )
        return window

    def __getitem__(self, i: int) -> torch.Tensor:
        """Window `i` as a LongTensor of shape (seq_len,)."""
        return torch.from_numpy(self._window(int(i)).astype(np.int64))

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Windows `indices` stacked into a LongTensor (len(indices), seq_len)."""
        out = np.empty((len(indices), self.seq_len), dtype=np.int64)
        for row, i in enumerate(indices):
            out[row] = self._window(int(i))
        return torch.from_numpy(out)


class BatchLoader:
    """Infinite, resumable iterator of this rank's slice of each global batch.

    Epoch `e` visits the windows in the order `olmo_order(seed, e, N)` (or 0..N-1 without shuffle); global
    batch `k` of the epoch is positions `[k*B, (k+1)*B)` of that order and rank `r` takes rows
    `[r*B/w, (r+1)*B/w)` of it. With `drop_last=False` an epoch's last, short batch is completed with the
    epoch's first windows, so every batch has the same shape.
    The state is (epoch, position of the next batch in the epoch's order, seed, order rule): resuming from it
    yields exactly the batches an uninterrupted run would have.
    """

    def __init__(
        self,
        dataset: TokenSequenceDataset,
        *,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = True,
        shuffle: bool = True,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if batch_size < 1 or batch_size % world_size:
            raise ValueError(
                f"global_train_batch_size={batch_size} must be a positive multiple of the world size {world_size}"
            )
        if seed < 0:
            raise ValueError(f"data.seed={seed} must be >= 0")
        if num_workers < 0:
            raise ValueError(f"data.num_workers={num_workers} must be >= 0")
        if drop_last and len(dataset) < batch_size:
            raise ValueError(
                f"the dataset has {len(dataset)} sequences of {dataset.seq_len} tokens, fewer than one global "
                f"batch of {batch_size}: add data, lower global_train_batch_size, or set data.drop_last=false"
            )
        if len(dataset) == 0:
            raise ValueError(f"the dataset has no sequence of {dataset.seq_len} tokens (shards too short)")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.pin_memory = pin_memory and torch.accelerator.is_available()
        if pin_memory and not self.pin_memory:
            log.info("data.pin_memory is set but no accelerator is available; batches are not pinned")
        self.epoch = 0
        self.position = 0
        self.order = ORDER
        self._batches: Iterator[torch.Tensor] | None = None

    @property
    def batches_per_epoch(self) -> int:
        """Global batches in one epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def state_dict(self) -> dict[str, int | str]:
        """Where the next batch comes from: everything needed to resume exactly, and the data it is a place in
        (window length and count, the shards in order), so that a resume over other data is refused rather than
        silently re-shuffled; and the tokenizer its shards were written with (an export checks its tokenizer)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "order": self.order,
            "seq_len": self.dataset.seq_len,
            "windows": len(self.dataset),
            "shards": self.dataset.layout(),
            **({"tokenizer_fingerprint": self.dataset.fingerprint} if self.dataset.fingerprint else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (from `state_dict()`); skipped batches are not read."""
        self.check_same_data(state)
        if int(state["epoch"]) < 0 or int(state["position"]) < 0:
            raise ValueError(f"data loader state {state} has a negative epoch or position")
        self.close()
        self.order = str(state.get("order", "legacy"))
        if self.order not in (ORDER, "legacy"):
            raise ValueError(f"data loader state has order {self.order!r}, which this spes does not know")
        self.epoch, self.position = self._normalize(int(state["epoch"]), int(state["position"]))

    def check_same_data(self, state: dict[str, Any]) -> None:
        """Refuse a state saved over another order or other data: its position would be a place in another
        permutation, repeating and skipping windows here (as OLMo-core refuses another seed or a dataset of another
        fingerprint). A state from an earlier spes names no data and is taken as it is. Public: a node checks its
        checkpoint's state when it is built, before it joins a server."""
        _check_counts(state)
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise ValueError(f"data loader state lacks {sorted(missing)}")
        fresh = "or load it into a new save_folder with restore_dataloader=false to read this data from its beginning"
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"data loader state was saved with data.seed={state['seed']} but this run uses data.seed={self.seed}: "
                f"resume with the seed it was saved with, {fresh}"
            )
        self._check_same_tokenizer(state)
        fix = f"resume with the data.paths and model.max_sequence_length it was saved with, {fresh}"
        if "seq_len" in state and int(state["seq_len"]) != self.dataset.seq_len:
            raise ValueError(
                f"data loader state was saved with windows of {state['seq_len']} tokens but this run's "
                f"model.max_sequence_length is {self.dataset.seq_len}: {fix}"
            )
        if "windows" in state and int(state["windows"]) != len(self.dataset):
            raise ValueError(
                f"data loader state was saved over {state['windows']} windows of data but this run's data.paths "
                f"hold {len(self.dataset)}: {fix}"
            )
        if "shards" in state and state["shards"] != self.dataset.layout():
            raise ValueError(
                "data loader state was saved over other shards than this run's data.paths hold, or the same ones in "
                f"another order (as many windows, {len(self.dataset)}, but window i is another one): {fix}"
            )

    def _check_same_tokenizer(self, state: dict[str, Any]) -> None:
        """Refuse a state saved over shards of another tokenizer: the model learned its token ids, so even the same
        file names and window counts are other data. A state or shards without a fingerprint are not checked."""
        saved, here = state.get("tokenizer_fingerprint"), self.dataset.fingerprint
        if saved is not None and here is not None and saved != here:
            raise ValueError(
                f"data loader state was saved over shards of tokenizer {str(saved)[:12]} but this run's data.paths "
                f"hold shards of tokenizer {here[:12]}: resume with the run's own shards (tokenized with "
                f"{str(saved)[:12]}), or start a new run (a new save_folder) to train on these"
            )

    def close(self) -> None:
        """Stop DataLoader workers, if any; iteration restarts them from the current state."""
        self._batches = None

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> torch.Tensor:
        if self._batches is None:
            self._batches = self._start_batches()
        batch = next(self._batches)
        self.epoch, self.position = self._normalize(self.epoch, self.position + self.batch_size)
        return batch

    def _epoch_done(self, position: int) -> bool:
        """Whether no batch of the epoch starts at `position`."""
        n = len(self.dataset)
        return position >= n or (self.drop_last and position + self.batch_size > n)

    def _normalize(self, epoch: int, position: int) -> tuple[int, int]:
        """(epoch, position) of the batch starting at `position`, rolling over to the next epoch."""
        return (epoch + 1, 0) if self._epoch_done(position) else (epoch, position)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        if self.order == "legacy":  # a run started by an earlier spes continues in its own order
            return np.random.default_rng([self.seed, epoch]).permutation(n)
        return olmo_order(self.seed, epoch, n)

    def _rank_indices(self) -> Iterator[np.ndarray]:
        """This rank's window indices of each global batch, from the current state on."""
        epoch, position = self.epoch, self.position
        per_rank = self.batch_size // self.world_size
        while True:
            order = self._epoch_order(epoch)
            while not self._epoch_done(position):
                batch = order[position : position + self.batch_size]
                if len(batch) < self.batch_size:
                    batch = np.concatenate([batch, np.resize(order, self.batch_size - len(batch))])
                yield batch[self.rank * per_rank : (self.rank + 1) * per_rank]
                position += self.batch_size
            epoch, position = epoch + 1, 0

    def _start_batches(self) -> Iterator[torch.Tensor]:
        if self.num_workers == 0:
            return (self._maybe_pin(self.dataset.get_batch(idx)) for idx in self._rank_indices())
        return self._worker_batches()

    def _worker_batches(self) -> Iterator[torch.Tensor]:
        """Batches read by DataLoader workers, their token ids checked here: torch re-raises a worker's error with
        the worker's traceback folded into its message (and its workers then take seconds to stop), so a batch
        holding an id past the vocabulary is read again here, for the reader's one-line refusal naming the shard."""
        unchecked = copy.copy(self.dataset)
        unchecked.vocab_size = None
        loader: DataLoader[torch.Tensor] = DataLoader(
            unchecked,  # type: ignore[arg-type]  # map-style: __len__ and __getitem__
            batch_sampler=_IndexStream(self),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )
        batches, vocab_size = iter(loader), self.dataset.vocab_size
        try:
            for idx, batch in zip(self._rank_indices(), batches):
                if vocab_size is not None and int(batch.max()) >= vocab_size:
                    self.dataset.get_batch(idx)
                yield batch
        finally:
            del batches  # NOTE: the workers stop now, not when a traceback holding this frame is collected

    def _maybe_pin(self, batch: torch.Tensor) -> torch.Tensor:
        return batch.pin_memory() if self.pin_memory else batch


_STATE_COUNTS = ("epoch", "position", "seed", "seq_len", "windows")


def _check_counts(state: Any) -> None:
    """ValueError unless `state` is a mapping whose counts are integers: a checkpoint's meta.json may hold any JSON
    there, and int() of it would pass a string, truncate a float, or raise a TypeError or OverflowError."""
    if not isinstance(state, dict):
        raise ValueError(f"data loader state {state!r} is not a mapping; the checkpoint's meta.json is damaged")
    for key in _STATE_COUNTS:
        if key in state and (not isinstance(state[key], int) or isinstance(state[key], bool)):
            raise ValueError(
                f"data loader state has {key}={state[key]!r}, not an integer; the checkpoint's meta.json is damaged"
            )


class _IndexStream:
    """The loader's index stream as a DataLoader batch sampler (DataLoader keeps batches in order)."""

    def __init__(self, loader: BatchLoader):
        self._loader = loader

    def __iter__(self) -> Iterator[list[int]]:
        return (idx.tolist() for idx in self._loader._rank_indices())


def iterate_eval_batches(
    dataset: TokenSequenceDataset,
    batch_size: int,
    max_batches: int | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[torch.Tensor]:
    """Windows 0..N-1 in order, in batches of `batch_size` (the last may be shorter).

    The same batches every call, so validation losses are comparable across steps and runs.
    At most `max_batches` batches in all; with `world_size > 1` rank `r` gets batches r, r+w, ...
    """
    if batch_size < 1:
        raise ValueError(f"eval batch_size must be >= 1, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    num_batches = math.ceil(len(dataset) / batch_size)
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    for b in range(rank, num_batches, world_size):
        yield dataset.get_batch(range(b * batch_size, min((b + 1) * batch_size, len(dataset))))


def repetitive_instances(tokens_BS: torch.Tensor, *, min_period: int, max_period: int, max_count: int) -> torch.Tensor:
    """(B,) bool: which windows hold at least `max_count` consecutive repeats of one token period.

    OLMo's `data.instance_filter` (the reference leaves such windows out of the loss). A period `p` in
    [min_period, max_period] repeats where `x[t] == x[t - p]`; a run of `r` such positions is a periodic
    stretch of `r + p` tokens, i.e. `(r + p) // p` whole repeats of its first `p` tokens.
    """
    batch, length = tokens_BS.shape
    found = torch.zeros(batch, dtype=torch.bool, device=tokens_BS.device)
    for period in range(min_period, min(max_period, length - 1) + 1):
        same_BL = tokens_BS[:, period:] == tokens_BS[:, :-period]
        pos_L = torch.arange(same_BL.shape[1], device=tokens_BS.device)
        # run length ending at t = t - (last position <= t where the tokens differed)
        last_break_BL = torch.where(same_BL, -1, pos_L).cummax(dim=1).values
        longest_B = (pos_L - last_break_BL).amax(dim=1)
        found |= (longest_B + period) // period >= max_count
    return found
