"""Tokenizers for spes: load a local Hugging Face tokenizer, train a byte-level BPE, check vocab sizes.

The trainer, the tokenization script and the default-corpus builder all meet here. Only the
light `tokenizers` library is used (never `transformers`): a tokenizer is a directory holding
`tokenizer.json` (what `transformers.AutoTokenizer` reads), a bare `tokenizer.json` file, or a
Hugging Face Hub id such as `Qwen/Qwen2.5-0.5B` (local cache first, see `spes.hub`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from spes.atomic import write_atomic
from spes.hub import resolve_tokenizer

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|padding|>"
# NOTE: names other tokenizers use for their end-of-document token, tried in this order when a
# bare tokenizer.json comes without a tokenizer_config.json that names it.
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>")
_TRAIN_HINT = (
    "Train one locally with `python data_process_scripts/train_tokenizer.py --input 'texts/*.txt' "
    "--output_dir my_tokenizer` (or run data_process_scripts/build_default_corpus.py, which writes "
    "data/default/tokenizer), or copy an existing tokenizer directory onto this machine and pass its path."
)


@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer with the facts the data pipeline and the trainer need about it."""

    tokenizer: Tokenizer
    path: Path
    """The tokenizer.json it was read from."""
    vocab_size: int
    """Number of token ids, added special tokens included (what model.vocab_size must equal)."""
    eos_token_id: int
    pad_token_id: int
    fingerprint: str
    """sha256 of the tokenizer.json bytes: shards record it so data and tokenizer cannot be mixed up."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens (the caller appends EOS).

        A literal "<|endoftext|>" inside a text is encoded as plain text, so only the pipeline
        decides where documents end.
        """
        return [enc.ids for enc in self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special tokens (EOS, pad) are kept so document ends stay visible."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(identifier: str | os.PathLike[str], what: str = "tokenizer") -> LoadedTokenizer:
    """Load a tokenizer from a directory (with tokenizer.json), a tokenizer.json file or a Hub id; `what` names it
    where it is not found (the config key, the flag).

    EOS and pad come from the directory's tokenizer_config.json when it names them, else from
    well-known token names; a tokenizer without a pad token pads with EOS.
    """
    try:
        path = resolve_tokenizer(identifier, what)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{err}. {_TRAIN_HINT}") from None
    if path.is_dir():
        json_path = path / "tokenizer.json"
        if not json_path.is_file():
            raise FileNotFoundError(
                f"tokenizer directory {path} has no tokenizer.json (only fast Hugging Face tokenizers are "
                f"supported). {_TRAIN_HINT}"
            )
    else:
        json_path = path
    raw = json_path.read_bytes()
    try:
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
        raise ValueError(f"{json_path} is not a valid Hugging Face tokenizer.json: {err}") from err
    tokenizer.encode_special_tokens = True
    config = _read_tokenizer_config(json_path.parent / "tokenizer_config.json")
    eos_id = _special_token_id(tokenizer, config.get("eos_token"), _EOS_CANDIDATES, json_path, "EOS")
    pad_id = _special_token_id(tokenizer, config.get("pad_token"), (PAD_TOKEN,), json_path, "pad", default=eos_id)
    return LoadedTokenizer(
        tokenizer=tokenizer,
        path=json_path,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        fingerprint=hashlib.sha256(raw).hexdigest(),
    )


def _read_tokenizer_config(path: Path) -> dict[str, object]:
    """The tokenizer_config.json beside a tokenizer.json, or {} when there is none."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return config


def _special_token_id(
    tokenizer: Tokenizer,
    configured: object,
    candidates: Sequence[str],
    json_path: Path,
    role: str,
    default: int | None = None,
) -> int:
    """Id of the special token named in the config (a string or {"content": ...}), else of a known name."""
    if isinstance(configured, dict):
        configured = configured.get("content")
    if isinstance(configured, str):
        token_id = tokenizer.token_to_id(configured)
        if token_id is None:
            raise ValueError(
                f"tokenizer_config.json beside {json_path} names {role} token {configured!r}, "
                f"which is not in the vocabulary"
            )
        return token_id
    for name in candidates:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    if default is not None:
        return default
    raise ValueError(
        f"tokenizer {json_path} defines no {role} token: add one of {list(candidates)} or name it as "
        f"'{role.lower()}_token' in a tokenizer_config.json beside it"
    )


def check_vocab(tokenizer_vocab_size: int, model_vocab_size: int, embedding_size: int | None) -> None:
    """Refuse a model whose vocabulary does not match the tokenizer the data was made with.

    `embedding_size` may exceed `vocab_size` (padded for speed) but never fall short of it; None
    means "same as model_vocab_size".
    """
    if model_vocab_size != tokenizer_vocab_size:
        raise ValueError(
            f"model.vocab_size={model_vocab_size} but the tokenizer has {tokenizer_vocab_size} tokens; "
            f"set model.vocab_size={tokenizer_vocab_size} (and model.embedding_size >= it)"
        )
    if embedding_size is not None and embedding_size < model_vocab_size:
        raise ValueError(
            f"model.embedding_size={embedding_size} is smaller than model.vocab_size={model_vocab_size}; "
            f"set model.embedding_size >= {model_vocab_size} (a multiple of 64 or 128 is fastest)"
        )


def check_bpe_vocab_size(vocab_size: int) -> None:
    """ValueError unless a byte-level BPE of `vocab_size` tokens holds every byte, EOS and pad."""
    num_bytes = len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < num_bytes + 2:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least "
            f"{num_bytes + 2} (256 bytes + EOS + pad)"
        )


def train_byte_level_bpe(
    texts: Iterable[str],
    *,
    vocab_size: int,
    output_dir: str | os.PathLike[str],
    min_frequency: int = 2,
    progress: bool = False,
) -> LoadedTokenizer:
    """Train a byte-level BPE on `texts` and save it as a Hugging Face tokenizer directory.

    Ids 0 and 1 are EOS (`<|endoftext|>`) and pad (`<|padding|>`). Byte-level means every string
    round-trips exactly, whatever its script. The directory holds tokenizer.json,
    tokenizer_config.json and special_tokens_map.json, which is what
    `transformers.AutoTokenizer.from_pretrained(output_dir)` needs, offline. `progress` draws the tokenizers
    library's own bars on stderr (they draw only on a terminal).
    """
    check_bpe_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tokenizer.train_from_iterator(texts, trainer)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    special = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1_000_000_000,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    write_atomic(out / "tokenizer.json", tokenizer.to_str(pretty=True))
    write_atomic(out / "special_tokens_map.json", json.dumps(special, indent=2))
    # NOTE: written last: a directory without tokenizer_config.json is an interrupted save.
    write_atomic(out / "tokenizer_config.json", json.dumps(config, indent=2))
    return load_tokenizer(out)
