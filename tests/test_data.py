"""Tests of spes.data: the windowed dataset, the resumable batch loader, eval batches."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from data_fixtures import write_token_shard
from spes.data import (
    BatchLoader,
    TokenSequenceDataset,
    check_eos,
    iterate_eval_batches,
    olmo_order,
    repetitive_instances,
)
from spes.shards import sidecar_path

# NOTE: a loader test takes a second at most; one whose loader never yields (an epoch that never starts, a loop over
# epochs without a batch) fails in 30 s, before mutmut's deadline for the module's tests counts it a timeout
pytestmark = pytest.mark.timeout(30)

SEQ_LEN = 4
LAYOUT = "dd89179a226bfbb5"
"""`TokenSequenceDataset.layout()` of the `shards` fixture: their names and window counts, in order."""


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    """Three shards of consecutive integers (103, 50 and 7 tokens) so each window shows where it came from."""
    sizes = [103, 50, 7]
    starts = np.cumsum([0] + sizes[:-1])
    return [
        write_token_shard(tmp_path / f"part_{i:05d}.npy", np.arange(s, s + n, dtype=np.uint16))
        for i, (s, n) in enumerate(zip(starts, sizes))
    ]


@pytest.fixture
def dataset(shards: list[Path]) -> TokenSequenceDataset:
    return TokenSequenceDataset(shards, SEQ_LEN)


def loader_state(epoch: int, position: int, seed: int) -> dict[str, int | str]:
    """A loader's state over the `shards` fixture's 38 windows of SEQ_LEN tokens."""
    return {
        "epoch": epoch,
        "position": position,
        "seed": seed,
        "order": "olmo",
        "seq_len": 4,
        "windows": 38,
        "shards": LAYOUT,
        "tokenizer_fingerprint": "0" * 64,  # write_token_shard's default
    }


def _take(loader: BatchLoader, n: int) -> list[torch.Tensor]:
    return [next(loader) for _ in range(n)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# --- TokenSequenceDataset -----------------------------------------------------------------------


def test_windows_stay_inside_shards_and_drop_remainders(dataset: TokenSequenceDataset) -> None:
    assert dataset.num_tokens == 160
    assert len(dataset) == 103 // SEQ_LEN + 50 // SEQ_LEN + 7 // SEQ_LEN == 38
    windows = [dataset[i] for i in range(len(dataset))]
    assert all(w.dtype == torch.long and w.shape == (SEQ_LEN,) for w in windows)
    assert all(torch.equal(w, torch.arange(int(w[0]), int(w[0]) + SEQ_LEN)) for w in windows)
    starts = [int(w[0]) for w in windows]
    assert starts[24] == 96 and starts[25] == 103 and starts[36] == 103 + 44 and starts[37] == 153
    assert [dataset.shard_windows(i) for i in range(3)] == [range(0, 25), range(25, 37), range(37, 38)]
    as_text = TokenSequenceDataset([str(p) for p in dataset.paths], SEQ_LEN)  # a local path as text is a Path
    assert as_text.paths == dataset.paths and all(isinstance(p, Path) for p in as_text.paths)
    assert torch.equal(dataset[-1], windows[-1])
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def _write_olmo_tokens(path: Path, tokens: np.ndarray) -> Path:
    """A token file as OLMo / Dolma / the first SPES implementation's tokenize_data.py write it: a flat
    np.memmap of the raw tokens, no numpy header, no sidecar."""
    array = np.memmap(path, dtype=tokens.dtype, mode="w+", shape=tokens.shape)
    array[:] = tokens
    array.flush()
    del array
    return path


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64"])
def test_headerless_olmo_files_are_read_with_memmap_dtype(
    tmp_path: Path, dtype: str, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = np.arange(70_000, 70_000 + 41, dtype=np.uint64).astype(dtype)  # > uint16 unless uint16
    paths = [_write_olmo_tokens(tmp_path / f"part-{i}-00000.npy", tokens) for i in range(2)]
    assert not sidecar_path(paths[0]).exists() and paths[0].read_bytes()[:6] != b"\x93NUMPY"
    with caplog.at_level("WARNING"):
        ds = TokenSequenceDataset(paths, SEQ_LEN, memmap_dtype=dtype)
    assert ds.fingerprint is None and len(ds) == 2 * (41 // SEQ_LEN) and ds.num_tokens == 82
    assert torch.equal(ds[1], torch.from_numpy(tokens[SEQ_LEN : 2 * SEQ_LEN].astype(np.int64)))
    notes = [r.getMessage() for r in caplog.records if "no .npy.json sidecar" in r.getMessage()]
    assert len(notes) == 1 and f"{paths[0]} (and 1 more)" in notes[0] and dtype in notes[0]
    assert "cannot be checked" in notes[0]


def test_headerless_file_defaults_to_uint16_and_a_wrong_dtype_is_named(tmp_path: Path) -> None:
    path = _write_olmo_tokens(tmp_path / "a.npy", np.arange(9, dtype=np.uint16))  # 18 bytes
    assert torch.equal(TokenSequenceDataset([path], SEQ_LEN)[1], torch.arange(4, 8))
    with pytest.raises(ValueError, match=f"{path} has 18 bytes.*memmap_dtype=uint32"):
        TokenSequenceDataset([path], SEQ_LEN, memmap_dtype="uint32")


def test_real_npy_without_sidecar_and_mixed_with_spes_shards(shards: list[Path], tmp_path: Path) -> None:
    plain = tmp_path / "plain.npy"
    np.save(plain, np.arange(500, 508, dtype=np.uint16))
    olmo = _write_olmo_tokens(tmp_path / "olmo.npy", np.arange(900, 908, dtype=np.uint16))
    ds = TokenSequenceDataset([shards[0], plain, olmo], SEQ_LEN, memmap_dtype="uint16")
    assert ds.fingerprint is not None and len(ds) == 25 + 2 + 2
    assert int(ds[25][0]) == 500 and int(ds[27][0]) == 900
    # the tokenizer the shards were written with travels in the loader's state, for an export to check
    assert BatchLoader(ds, batch_size=4, seed=1).state_dict()["tokenizer_fingerprint"] == ds.fingerprint
    bare = TokenSequenceDataset([plain, olmo], SEQ_LEN, memmap_dtype="uint16")  # no sidecar names a tokenizer
    assert bare.fingerprint is None
    assert "tokenizer_fingerprint" not in BatchLoader(bare, batch_size=4, seed=1).state_dict()


def test_dataset_refuses_a_half_written_shard(tmp_path: Path) -> None:
    partial = tmp_path / "part_00000.npy.partial"
    np.save(tmp_path / "x.npy", np.arange(8, dtype=np.uint16))
    (tmp_path / "x.npy").replace(partial)
    with pytest.raises(ValueError, match=f"{partial} is half-written"):
        TokenSequenceDataset([partial], SEQ_LEN)


def test_dataset_refuses_a_dtype_other_than_memmap_dtype(shards: list[Path]) -> None:
    with pytest.raises(ValueError, match=f"{shards[0]} holds uint16.*memmap_dtype is uint32"):
        TokenSequenceDataset(shards, SEQ_LEN, memmap_dtype="uint32")
    assert len(TokenSequenceDataset(shards, SEQ_LEN, memmap_dtype="uint16")) == 38


def test_dataset_refuses_values_that_are_not_token_ids(tmp_path: Path) -> None:
    """Floats or signed values are no tokenizer's output; an id past the vocabulary is found as its window is read
    (a sidecar names the tokenizer, an OLMo file none), naming the shard and where in it."""
    for dtype in (np.float32, np.int32):
        np.save(tmp_path / "x.npy", np.zeros(16, dtype=dtype))
        with pytest.raises(ValueError) as err:
            TokenSequenceDataset([tmp_path / "x.npy"], SEQ_LEN)
        named = f"token shard {tmp_path / 'x.npy'} holds {np.dtype(dtype)} values"
        assert str(err.value) == f"{named}; token ids are unsigned (uint16, uint32)"
    vocab = 2 * SEQ_LEN
    tokens = np.concatenate([np.arange(vocab), np.full(SEQ_LEN, vocab)]).astype(np.uint16)
    shard = write_token_shard(tmp_path / "a.npy", tokens, with_sidecar=False)
    dataset = TokenSequenceDataset([shard], SEQ_LEN, vocab_size=vocab)
    assert dataset[1].tolist() == tokens[SEQ_LEN:vocab].tolist()  # its largest id is vocab_size - 1
    with pytest.raises(ValueError) as err:
        dataset.get_batch([0, 2])  # window 2 holds vocab_size itself
    assert str(err.value) == (
        f"token shard {shard} holds token id {vocab} (in tokens {vocab}..{vocab + SEQ_LEN - 1}), past model."
        f"vocab_size={vocab}: it was tokenized with another tokenizer; retokenize it or leave it out of data.paths"
    )


@pytest.mark.timeout(60)
def test_a_token_id_past_the_vocabulary_read_by_a_worker_is_refused_in_one_line(tmp_path: Path) -> None:
    """torch re-raises a worker's error with the worker's traceback folded into its message: the loader checks the
    ids of a worker's batch in its own process and reads a bad one again there, for the reader's one-line refusal."""
    vocab = 2 * SEQ_LEN
    shard = write_token_shard(tmp_path / "a.npy", np.full(4 * SEQ_LEN, vocab, dtype=np.uint16), with_sidecar=False)
    loader = BatchLoader(TokenSequenceDataset([shard], SEQ_LEN, vocab_size=vocab), batch_size=2, seed=0, num_workers=1)
    try:
        with pytest.raises(ValueError) as err:
            next(loader)
    finally:
        loader.close()
    assert str(err.value).startswith(f"token shard {shard} holds token id {vocab} (in tokens ")
    assert "\n" not in str(err.value)


def test_dataset_refuses_shard_and_sidecar_that_disagree(tmp_path: Path) -> None:
    path = write_token_shard(tmp_path / "a.npy", np.arange(10, dtype=np.uint16))
    write_token_shard(tmp_path / "b.npy", np.arange(10, dtype=np.uint32), with_sidecar=False)
    (tmp_path / "b.npy").replace(path)  # a uint32 array under a uint16 sidecar
    with pytest.raises(ValueError, match="does not match its sidecar"):
        TokenSequenceDataset([path], SEQ_LEN)


def test_dataset_refuses_shards_from_different_tokenizers(tmp_path: Path) -> None:
    a = write_token_shard(tmp_path / "a.npy", np.arange(10, dtype=np.uint16), fingerprint="a" * 64)
    b = write_token_shard(tmp_path / "b.npy", np.arange(10, dtype=np.uint16), fingerprint="b" * 64)
    with pytest.raises(ValueError, match="different tokenizers"):
        TokenSequenceDataset([a, b], SEQ_LEN)


def test_the_first_shard_of_another_eos_is_named_and_bare_shards_pass(tmp_path: Path) -> None:
    tokens = np.arange(10, dtype=np.uint16)
    bare = write_token_shard(tmp_path / "bare.npy", tokens, with_sidecar=False)
    shards = [bare, *(write_token_shard(tmp_path / f"{e}.npy", tokens, eos_token_id=e) for e in (3, 5, 6))]
    ds = TokenSequenceDataset(shards, SEQ_LEN)
    check_eos(ds.paths[:2], ds.shard_infos[:2], 3)
    with pytest.raises(ValueError) as err:
        check_eos(ds.paths, ds.shard_infos, 3)
    assert str(err.value) == (
        f"token shard {shards[2]} ends its documents with token 5 but model.eos_token_id is 3; "
        "set model.eos_token_id=5 (its tokenizer's EOS) or re-tokenize it"
    )


def test_pickled_dataset_maps_its_shards_again_instead_of_copying(dataset: TokenSequenceDataset) -> None:
    dataset[0]
    clone = pickle.loads(pickle.dumps(dataset))
    assert all(a is None for a in clone._arrays)
    assert torch.equal(clone[37], dataset[37])


# --- BatchLoader --------------------------------------------------------------------------------


def test_same_seed_same_order_other_seed_other_order(dataset: TokenSequenceDataset) -> None:
    first = _take(BatchLoader(dataset, batch_size=8, seed=6198), 6)
    assert _same(first, _take(BatchLoader(dataset, batch_size=8, seed=6198), 6))
    assert not _same(first, _take(BatchLoader(dataset, batch_size=8, seed=7198), 6))
    assert all(b.shape == (8, SEQ_LEN) and b.dtype == torch.long for b in first)


def test_each_epoch_is_a_new_permutation_and_epochs_roll_over(dataset: TokenSequenceDataset) -> None:
    loader = BatchLoader(dataset, batch_size=9, seed=0)  # 38 windows: 4 batches an epoch, 2 dropped
    assert loader.batches_per_epoch == 4
    epochs = [torch.cat(_take(loader, 4))[:, 0].tolist() for _ in range(3)]
    all_starts = {int(dataset[i][0]) for i in range(len(dataset))}
    for starts in epochs:
        assert len(set(starts)) == 36 and set(starts) <= all_starts
    assert epochs[0] != epochs[1] != epochs[2]
    assert loader.state_dict() == loader_state(3, 0, 0)


def test_ranks_take_disjoint_slices_of_the_same_global_batch(dataset: TokenSequenceDataset) -> None:
    whole = _take(BatchLoader(dataset, batch_size=12, seed=3), 5)
    parts = [_take(BatchLoader(dataset, batch_size=12, seed=3, rank=r, world_size=3), 5) for r in range(3)]
    for step, batch in enumerate(whole):
        assert all(p[step].shape == (4, SEQ_LEN) for p in parts)
        assert torch.equal(torch.cat([p[step] for p in parts]), batch)


def test_resume_mid_epoch_yields_the_same_batches(dataset: TokenSequenceDataset) -> None:
    uninterrupted = _take(BatchLoader(dataset, batch_size=6, seed=11, rank=1, world_size=2), 20)
    first = BatchLoader(dataset, batch_size=6, seed=11, rank=1, world_size=2)
    head = _take(first, 3)
    state = first.state_dict()
    assert state == loader_state(0, 18, 11)
    resumed = BatchLoader(dataset, batch_size=6, seed=11, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert _same(head + _take(resumed, 17), uninterrupted)


def test_resume_at_an_epoch_boundary_and_after_reloading_state(dataset: TokenSequenceDataset) -> None:
    uninterrupted = _take(BatchLoader(dataset, batch_size=19, seed=5), 7)
    loader = BatchLoader(dataset, batch_size=19, seed=5)
    _take(loader, 2)
    assert loader.state_dict() == loader_state(1, 0, 5)
    _take(loader, 3)
    loader.load_state_dict({"epoch": 1, "position": 0, "seed": 5, "order": "olmo"})  # rewind a live loader
    assert _same(_take(loader, 5), uninterrupted[2:])


def _reference_epoch(seed: int, epoch: int, n: int) -> np.ndarray:
    """The first implementation's (OLMo's IterableDataset) global order, written from its rule: the indices
    0..n-1 as uint32, shuffled in place by numpy's Generator(PCG64(seed + epoch))."""
    indices = np.arange(n, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(seed=seed + epoch)).shuffle(indices)
    return indices


def test_epochs_follow_the_first_implementations_order(dataset: TokenSequenceDataset) -> None:
    """Global batch k of epoch e is positions [k*B, (k+1)*B) of the first implementation's order for the node's
    seed: the same windows, in the same order, as its node read (6198, 7198, ... its node files' seeds)."""
    for seed in (6198, 7198):
        assert np.array_equal(olmo_order(seed, 1, 1000), _reference_epoch(seed, 1, 1000))
        loader = BatchLoader(dataset, batch_size=9, seed=seed)
        for epoch in range(2):
            order = _reference_epoch(seed, epoch, len(dataset))
            for k, batch in enumerate(_take(loader, loader.batches_per_epoch)):
                expected = dataset.get_batch(order[k * 9 : (k + 1) * 9])
                assert torch.equal(batch, expected), (seed, epoch, k)


def test_a_state_of_an_earlier_spes_resumes_in_its_own_order(dataset: TokenSequenceDataset) -> None:
    """A checkpoint written before the order rule changed holds no "order": its run continues in the order it
    started with (numpy default_rng([seed, epoch])), so a resume is still exact."""
    loader = BatchLoader(dataset, batch_size=6, seed=3)
    # NOTE: epoch 1: numpy seeds default_rng([3, 0]) as it seeds PCG64(3) (a trailing zero adds no entropy), so in
    # epoch 0 the two orders are one and the same
    loader.load_state_dict({"epoch": 1, "position": 12, "seed": 3})
    legacy = np.random.default_rng([3, 1]).permutation(len(dataset))
    assert not np.array_equal(legacy, olmo_order(3, 1, len(dataset)))
    assert torch.equal(next(loader), dataset.get_batch(legacy[12:18]))
    assert loader.state_dict()["order"] == "legacy"
    with pytest.raises(ValueError, match="order 'other'"):
        loader.load_state_dict({"epoch": 0, "position": 0, "seed": 3, "order": "other"})


def test_load_state_dict_refuses_another_seed(dataset: TokenSequenceDataset) -> None:
    loader = BatchLoader(dataset, batch_size=4, seed=1)
    with pytest.raises(ValueError) as err:
        loader.load_state_dict({"epoch": 0, "position": 4, "seed": 2})
    assert str(err.value) == (
        "data loader state was saved with data.seed=2 but this run uses data.seed=1: resume with the seed it was "
        "saved with, or load it into a new save_folder with restore_dataloader=false to read this data from its "
        "beginning"
    )


def test_a_state_saved_over_other_data_is_refused_naming_what_changed(shards: list[Path]) -> None:
    """Another window length or window count makes the saved position a place in another permutation (repeating
    and skipping windows): refused, naming the key; the same data resumes, and an earlier spes' state naming no
    data is taken as it is."""
    state = BatchLoader(TokenSequenceDataset(shards, SEQ_LEN), batch_size=4, seed=1).state_dict()
    for other, message in [
        (
            TokenSequenceDataset(shards, SEQ_LEN + 1),
            "windows of 4 tokens but this run's model.max_sequence_length is 5",
        ),
        (TokenSequenceDataset(shards[:2], SEQ_LEN), "saved over 38 windows of data but this run's data.paths hold 37"),
    ]:
        with pytest.raises(ValueError) as err:
            BatchLoader(other, batch_size=4, seed=1).load_state_dict(state)
        assert str(err.value).endswith(
            f"{message}: resume with the data.paths and model.max_sequence_length it was saved with, or load it "
            "into a new save_folder with restore_dataloader=false to read this data from its beginning"
        )
        BatchLoader(other, batch_size=4, seed=1).load_state_dict({"epoch": 0, "position": 4, "seed": 1})
    BatchLoader(TokenSequenceDataset(shards, SEQ_LEN), batch_size=4, seed=1).load_state_dict(state)


def test_a_state_saved_over_the_shards_in_another_order_is_refused(shards: list[Path], tmp_path: Path) -> None:
    """Reordered data.paths hold as many windows, but window i is another one: the window count let it through, to
    repeat and skip data. The same shards read from another directory are the same data."""
    state = BatchLoader(TokenSequenceDataset(shards, SEQ_LEN), batch_size=4, seed=1).state_dict()
    reordered = TokenSequenceDataset([shards[1], shards[0], shards[2]], SEQ_LEN)
    with pytest.raises(ValueError) as err:
        BatchLoader(reordered, batch_size=4, seed=1).load_state_dict(state)
    assert str(err.value) == (
        "data loader state was saved over other shards than this run's data.paths hold, or the same ones in another "
        "order (as many windows, 38, but window i is another one): resume with the data.paths and "
        "model.max_sequence_length it was saved with, or load it into a new save_folder with restore_dataloader=false "
        "to read this data from its beginning"
    )
    moved = tmp_path / "moved"
    moved.mkdir()
    copies = [Path(shutil.copy(p, moved)) for p in shards]
    for p in shards:
        shutil.copy(sidecar_path(p), moved)
    BatchLoader(TokenSequenceDataset(copies, SEQ_LEN), batch_size=4, seed=1).load_state_dict(state)


def test_a_state_saved_over_shards_of_another_tokenizer_is_refused(tmp_path: Path) -> None:
    """Shards retokenized under the same names (as many windows) are other data to a model that learned the first
    tokenizer's ids: the resume went on. A state or shards naming no tokenizer are not checked."""
    retokenized = tmp_path / "retokenized"
    retokenized.mkdir()
    runs = {
        f: [write_token_shard(d / "part_00000.npy", np.arange(40, dtype=np.uint16), fingerprint=f)]
        for f, d in (("a" * 64, tmp_path), ("b" * 64, retokenized))
    }
    state = BatchLoader(TokenSequenceDataset(runs["a" * 64], SEQ_LEN), batch_size=4, seed=1).state_dict()
    with pytest.raises(ValueError) as err:
        BatchLoader(TokenSequenceDataset(runs["b" * 64], SEQ_LEN), batch_size=4, seed=1).load_state_dict(state)
    assert str(err.value) == (
        "data loader state was saved over shards of tokenizer aaaaaaaaaaaa but this run's data.paths hold shards of "
        "tokenizer bbbbbbbbbbbb: resume with the run's own shards (tokenized with aaaaaaaaaaaa), or start a new run "
        "(a new save_folder) to train on these"
    )
    BatchLoader(TokenSequenceDataset(runs["a" * 64], SEQ_LEN), batch_size=4, seed=1).load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "tokenizer_fingerprint"}
    BatchLoader(TokenSequenceDataset(runs["b" * 64], SEQ_LEN), batch_size=4, seed=1).load_state_dict(older)
    sidecar_path(runs["b" * 64][0]).unlink()
    BatchLoader(TokenSequenceDataset(runs["b" * 64], SEQ_LEN), batch_size=4, seed=1).load_state_dict(state)


@pytest.mark.timeout(60)
def test_worker_processes_yield_the_same_batches(dataset: TokenSequenceDataset) -> None:
    expected = _take(BatchLoader(dataset, batch_size=4, seed=9), 15)
    loader = BatchLoader(dataset, batch_size=4, seed=9, num_workers=2, pin_memory=True)
    try:
        head = _take(loader, 5)
        state = loader.state_dict()
        loader.load_state_dict(state)  # restarts the workers from the state, not from what they prefetched
        assert _same(head + _take(loader, 10), expected)
    finally:
        loader.close()


def test_without_drop_last_every_window_is_seen_and_shapes_stay_fixed(dataset: TokenSequenceDataset) -> None:
    loader = BatchLoader(dataset, batch_size=16, seed=2, drop_last=False)
    assert loader.batches_per_epoch == 3
    epoch = _take(loader, 3)
    assert all(b.shape == (16, SEQ_LEN) for b in epoch)
    assert len({int(s) for s in torch.cat(epoch)[:, 0]}) == len(dataset)
    assert loader.state_dict()["epoch"] == 1


def test_no_shuffle_reads_in_order(dataset: TokenSequenceDataset) -> None:
    batch = next(BatchLoader(dataset, batch_size=4, seed=0, shuffle=False))
    assert batch[:, 0].tolist() == [0, 4, 8, 12]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 10, "world_size": 3}, "multiple of the world size"),
        ({"batch_size": 39}, "fewer than one"),
        ({"batch_size": 4, "rank": 2, "world_size": 2}, "rank=2"),
        ({"batch_size": 4, "seed": -1}, "data.seed"),
    ],
)
def test_loader_refuses_impossible_settings(dataset: TokenSequenceDataset, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchLoader(dataset, **{"seed": 0, **kwargs})


# --- iterate_eval_batches -----------------------------------------------------------------------


def test_eval_batches_are_fixed_and_cover_the_dataset_in_order(dataset: TokenSequenceDataset) -> None:
    batches = list(iterate_eval_batches(dataset, 16, None))
    assert [b.shape[0] for b in batches] == [16, 16, 6]
    assert torch.equal(torch.cat(batches), torch.stack([dataset[i] for i in range(len(dataset))]))
    assert len(list(iterate_eval_batches(dataset, 16, 2))) == 2
    ranks = [list(iterate_eval_batches(dataset, 16, None, rank=r, world_size=2)) for r in range(2)]
    assert [len(r) for r in ranks] == [2, 1] and torch.equal(ranks[1][0], batches[1])


def test_repetition_filter_on_crafted_windows() -> None:
    """OLMo's defaults (periods 1..13, 32 repeats): a window is filtered only by a long enough run of one period."""
    rng = torch.Generator().manual_seed(0)
    noise = torch.randint(100, 4000, (200,), generator=rng)  # no period repeats in random ids this sparse
    period3 = torch.tensor([7, 8, 9])

    def window(run: torch.Tensor) -> torch.Tensor:
        return torch.cat([noise[:40], run, noise[40 : 200 - len(run)]])

    batch = torch.stack(
        [
            noise,  # kept
            window(period3.repeat(32)),  # 32 repeats of a 3-token period: filtered
            window(period3.repeat(31)),  # 31 repeats: kept
            window(torch.full((32,), 5)),  # one token 32 times (period 1): filtered
            window(torch.arange(14).repeat(8)),  # period 14 is longer than max_period: kept
        ]
    )
    got = repetitive_instances(batch, min_period=1, max_period=13, max_count=32)
    assert got.tolist() == [False, True, False, True, False]
    assert repetitive_instances(batch, min_period=1, max_period=14, max_count=8).tolist() == [
        False,
        True,
        True,
        True,
        True,
    ]
    # 32 equal tokens are only 16 repeats of period 2: without period 1 that window is kept
    assert repetitive_instances(batch, min_period=2, max_period=13, max_count=32)[3].item() is False


def _oracle_repetitive(window: list[int], min_period: int, max_period: int, max_count: int) -> bool:
    """The filter's definition, position by position: a run of r positions t with x[t] == x[t - p] (r may be 0)
    is r + p periodic tokens, (r + p) // p whole repeats of its first p; periods p < the window's length."""
    for p in range(min_period, min(max_period, len(window) - 1) + 1):
        run = longest = 0
        for t in range(p, len(window)):
            run = run + 1 if window[t] == window[t - p] else 0
            longest = max(longest, run)
        if (longest + p) // p >= max_count:
            return True
    return False


@pytest.mark.parametrize("length", [2, 3, 9, 24])
def test_the_repetition_filter_is_its_definition_at_every_edge(length: int) -> None:
    """Windows made of short periodic stretches in noise, at every period bound (max_period past the window
    included) and count threshold, against the definition computed position by position."""
    gen = torch.Generator().manual_seed(length)
    windows = []
    for _ in range(40):
        period = int(torch.randint(1, 5, (1,), generator=gen))
        stretch = torch.randint(0, 3, (period,), generator=gen).repeat(length)[
            : int(torch.randint(1, length + 1, (1,), generator=gen))
        ]
        noise = torch.randint(10, 10_000, (length,), generator=gen)
        start = int(torch.randint(0, length - len(stretch) + 1, (1,), generator=gen))
        noise[start : start + len(stretch)] = stretch
        windows.append(noise)
    batch = torch.stack(windows)
    for min_period, max_period in ((1, 1), (1, 3), (2, 4), (1, length - 1), (1, length + 5)):
        for max_count in (1, 2, 3, 4, 6):
            got = repetitive_instances(batch, min_period=min_period, max_period=max_period, max_count=max_count)
            want = [_oracle_repetitive(w.tolist(), min_period, max_period, max_count) for w in batch]
            assert got.tolist() == want, (min_period, max_period, max_count)


@pytest.mark.gpu
def test_the_repetition_filter_runs_on_a_gpu() -> None:
    batch = torch.tensor([[5, 5, 5, 5, 1, 2], [1, 2, 3, 4, 5, 6]], device="cuda")
    got = repetitive_instances(batch, min_period=1, max_period=3, max_count=4)
    assert got.device.type == "cuda" and got.tolist() == [True, False]


def test_without_drop_last_an_epoch_of_whole_batches_has_no_extra_batch(dataset: TokenSequenceDataset) -> None:
    """38 windows in batches of 19: two batches an epoch, the third is the next epoch's first."""
    loader = BatchLoader(dataset, batch_size=19, seed=4, drop_last=False)
    batches = _take(loader, 3)
    order = olmo_order(4, 1, len(dataset))
    assert torch.equal(batches[2], dataset.get_batch(order[:19]))
    assert loader.state_dict()["epoch"] == 1


def test_the_smallest_settings_are_allowed(shards: list[Path]) -> None:
    """A batch of one window, a dataset of exactly one batch, one window without drop_last, windows of one token."""
    dataset = TokenSequenceDataset(shards, SEQ_LEN)
    assert next(BatchLoader(dataset, batch_size=1, seed=0, shuffle=False))[0].tolist() == [0, 1, 2, 3]
    assert len(_take(BatchLoader(dataset, batch_size=len(dataset), seed=0), 2)) == 2
    one = TokenSequenceDataset(shards[2:], 7)
    assert len(one) == 1 and next(BatchLoader(one, batch_size=1, seed=0, drop_last=False)).shape == (1, 7)
    assert len(TokenSequenceDataset(shards, 1)) == 160


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"epoch": 0, "seed": 0}, "data loader state lacks ['position']"),
        ({"epoch": 0, "position": -4, "seed": 0}, "has a negative epoch or position"),
        ({"epoch": -1, "position": 0, "seed": 0}, "has a negative epoch or position"),
    ],
)
def test_a_bad_loader_state_is_refused_naming_what_is_wrong(
    dataset: TokenSequenceDataset, state: dict, message: str
) -> None:
    with pytest.raises(ValueError) as err:
        BatchLoader(dataset, batch_size=4, seed=0).load_state_dict(state)
    assert message in str(err.value)


def test_settings_and_shards_are_refused_in_one_line_naming_the_culprit(shards: list[Path], tmp_path: Path) -> None:
    dataset = TokenSequenceDataset(shards, SEQ_LEN)
    cases = [
        (lambda: BatchLoader(dataset, batch_size=4, seed=0, num_workers=-1), "data.num_workers=-1 must be >= 0"),
        (
            lambda: BatchLoader(TokenSequenceDataset(shards[2:], 8), batch_size=1, seed=0, drop_last=False),
            "the dataset has no sequence of 8 tokens (shards too short)",
        ),
        (lambda: TokenSequenceDataset(shards, 0), "seq_len must be >= 1, got 0"),
        (lambda: TokenSequenceDataset([], 4), "TokenSequenceDataset needs at least one token shard"),
        (
            lambda: TokenSequenceDataset([tmp_path / "x.bin"], 4),
            f"token shard {tmp_path / 'x.bin'} is not a .npy file (tokenize_data.py writes .npy shards)",
        ),
        (lambda: iterate_eval_batches(dataset, 0).__next__(), "eval batch_size must be >= 1, got 0"),
        (
            lambda: iterate_eval_batches(dataset, 4, rank=2, world_size=2).__next__(),
            "rank=2 must be in [0, world_size=2)",
        ),
    ]
    two_d = tmp_path / "two_d.npy"
    np.save(two_d, np.zeros((3, 4), dtype=np.uint16))
    cases.append(
        (lambda: TokenSequenceDataset([two_d], 4), f"token shard {two_d} holds a 2-D array; token shards are 1-D")
    )
    for make, message in cases:
        with pytest.raises(ValueError) as err:
            make()
        assert str(err.value) == message
    assert next(iterate_eval_batches(dataset, 1)).shape == (1, SEQ_LEN)
    assert next(iterate_eval_batches(dataset, 4, rank=1, world_size=2)).shape == (4, SEQ_LEN)


def test_shards_without_sidecars_are_noted_once_and_counted(
    shards: list[Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bare = [tmp_path / f"bare_{i}.npy" for i in range(3)]
    for path in bare:
        np.save(path, np.arange(8, dtype=np.uint16))
    with caplog.at_level("WARNING", "spes.data"):
        TokenSequenceDataset([shards[0], *bare], SEQ_LEN)
        TokenSequenceDataset(bare[:1], SEQ_LEN)
    notes = [r.getMessage() for r in caplog.records]
    assert notes[0].startswith(f"note: token shard {bare[0]} (and 2 more) has no .npy.json sidecar")
    assert notes[1].startswith(f"note: token shard {bare[0]} has no .npy.json sidecar")


def test_the_other_tokenizers_shard_is_named_beside_the_first(tmp_path: Path) -> None:
    paths = [
        write_token_shard(tmp_path / f"part_{i}.npy", np.arange(8, dtype=np.uint16), fingerprint=f)
        for i, f in enumerate(["aaa", "bbb", "bbb"])
    ]
    with pytest.raises(ValueError) as err:
        TokenSequenceDataset(paths, 4)
    assert str(err.value) == (
        f"token shards were made with different tokenizers: {paths[0]} and {paths[1]}; "
        "tokenize all data with the same tokenizer"
    )


def test_windows_count_back_from_the_end_and_each_shard_is_mapped_once(
    shards: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import spes.data

    opened: list[Path] = []
    real = spes.data.open_token_array

    def counting(path: Path, dtype: str | None) -> np.ndarray:
        opened.append(path)
        return real(path, dtype)

    monkeypatch.setattr(spes.data, "open_token_array", counting)
    dataset = TokenSequenceDataset(shards, SEQ_LEN)
    assert torch.equal(dataset[-len(dataset)], dataset[0]) and torch.equal(dataset[-1], dataset[len(dataset) - 1])
    dataset.get_batch(range(len(dataset)))
    assert sorted(opened) == sorted(shards)
    assert dataset._window_starts.dtype == np.int64
    with pytest.raises(
        IndexError, match=f"^window {len(dataset)} out of range for a dataset of {len(dataset)} windows$"
    ):
        dataset[len(dataset)]


def test_pin_memory_without_an_accelerator_is_said_and_not_done(
    dataset: TokenSequenceDataset, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    with caplog.at_level("INFO", "spes.data"):
        plain = BatchLoader(dataset, batch_size=4, seed=0)
        assert not caplog.records and plain.pin_memory is False
        asked = BatchLoader(dataset, batch_size=4, seed=0, pin_memory=True)
    assert asked.pin_memory is False and not next(asked).is_pinned()
    assert [r.getMessage() for r in caplog.records] == [
        "data.pin_memory is set but no accelerator is available; batches are not pinned"
    ]


@pytest.mark.timeout(60)
def test_by_default_batches_are_read_in_this_process(
    dataset: TokenSequenceDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No worker process unless data.num_workers asks for one: a worker costs a process per loader and its memory."""
    readers: list[int] = []
    window = TokenSequenceDataset._window
    monkeypatch.setattr(TokenSequenceDataset, "_window", lambda self, i: readers.append(os.getpid()) or window(self, i))
    loader = BatchLoader(dataset, batch_size=4, seed=0)
    try:
        assert next(loader).shape == (4, SEQ_LEN)
    finally:
        loader.close()
    assert readers and set(readers) == {os.getpid()}  # a forked worker's reads land in its own copy of the list
