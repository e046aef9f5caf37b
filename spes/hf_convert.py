"""Hugging Face export and import of spes checkpoints: the tensors and the files, through the key map of
`spes.hf_map` (whose docstring says how the names and layouts correspond). Safetensors only: pickled weights are
never loaded. `python -m spes.hf` is the command line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import is_dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from spes.atomic import staging_dir
from spes.checkpoint import load_model_state, save_checkpoint, trainer_state
from spes.config import ModelConfig, SpesConfig, TokenizerConfig, TrainConfig
from spes.hf_map import (
    DENSE_MODEL_TYPES,
    EXPORT_DTYPES,
    FAMILIES,
    choose_family,
    hf_config_dict,
    implicit_norm_shapes,
    model_config_from_hf,
)
from spes.hub import TOKENIZER_FILES, resolve, resolve_tokenizer
from spes.moe import fuse_expert_blocks, split_expert_blocks
from spes.save_folder import CONFIG_FILE, LATEST, META_FILE, resolve_checkpoint
from spes.schema import ConfigError, from_dict, read_mapping, to_dict
from spes.tokenizer import check_vocab, load_tokenizer

_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in EXPORT_DTYPES}
log = logging.getLogger(__name__)
MAX_SHARD_BYTES = 5 * 1024**3


# ---------------------------------------------------------------------------------------------------------------
# Tensors: one part of a spes state <-> HF tensors, by a key map


def spes_to_hf(
    state: Mapping[str, torch.Tensor], keys: Mapping[str, str], m: ModelConfig, *, layer: int | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of one part of a fused spes state: the global tensors (layer=None) or one layer's.

    `keys` is a key map (spes template -> HF template), e.g. `HFFamily.key_map()`.

    Tensors are returned as views (experts transposed); the writer makes them contiguous.
    """
    ones = implicit_norm_shapes(m)
    for spes_t, hf_t in keys.items():
        if ("{l}" in spes_t) != (layer is not None):
            continue
        spes_key, hf_key = spes_t.format(l=layer), hf_t.format(l=layer, e="{e}")
        if spes_key in ones and spes_key not in state:
            yield hf_key, torch.ones(ones[spes_key])
            continue
        if spes_key not in state:
            raise ValueError(
                f"checkpoint has no tensor '{spes_key}' (expected for this model config); is it a "
                f"checkpoint of this model?"
            )
        tensor = state[spes_key]
        if "{e}" in hf_key:
            for e in range(tensor.shape[0]):
                yield hf_key.format(e=e), tensor[e].T
        else:
            yield hf_key, tensor


def _layered(template: str, n_layers: int) -> list[tuple[int | None, str]]:
    return [(i, template.format(l=i, e="{e}")) for i in range(n_layers)] if "{l}" in template else [(None, template)]


def hf_to_spes(
    hf_state: Mapping[str, torch.Tensor], keys: Mapping[str, str], m: ModelConfig, *, architecture: str
) -> dict[str, torch.Tensor]:
    """The fused spes state of an HF state (per-expert layout); refuses missing and unused HF tensors.

    An HF model with tied embeddings (no `lm_head.weight`) gets an untied copy: spes is always untied.
    """
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in hf_state:
            raise ValueError(f"Hugging Face weights have no tensor '{key}' (expected for {architecture})")
        used.add(key)
        return hf_state[key]

    for spes_t, hf_t in keys.items():
        for layer, hf_key in _layered(hf_t, m.n_layers):
            spes_key = spes_t.format(l=layer)
            if "{e}" in hf_key:
                out[spes_key] = torch.stack([take(hf_key.format(e=e)).T for e in range(m.moe_num_experts)])
            elif hf_key == "lm_head.weight" and hf_key not in hf_state:
                out[spes_key] = take("model.embed_tokens.weight").clone()
            else:
                out[spes_key] = take(hf_key)
    unused = sorted(k for k in hf_state if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(
            f"Hugging Face weights hold {len(unused)} tensors spes has no place for (e.g. "
            f"{unused[:3]}); biases, shared experts and dense layers are not supported"
        )
    return {k: v.float().contiguous() for k, v in out.items()}


# ---------------------------------------------------------------------------------------------------------------
# Files


class SafetensorsState(Mapping[str, torch.Tensor]):
    """Tensors of one or more .safetensors files (an HF model's shards), each read when accessed."""

    def __init__(self, files: Iterable[Path]) -> None:
        self._where: dict[str, Path] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    self._where[key] = path

    def __getitem__(self, key: str) -> torch.Tensor:
        with safe_open(str(self._where[key]), framework="pt") as f:
            return f.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_step_config(step_dir: Path) -> TrainConfig:
    """The run config saved with a checkpoint step."""
    path = step_dir / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{step_dir} is not a spes checkpoint: it has no {CONFIG_FILE} (expected a "
            f"<save_folder>/step<N> directory written by spes training)"
        )
    raw = read_mapping(TrainConfig, path, (), str(path))
    return from_dict(TrainConfig, _keys_of_now(TrainConfig, raw), where=str(path))


def _keys_of_now(cls: type, raw: Mapping[str, Any]) -> dict[str, Any]:
    """A config an earlier spes saved, each key a section renamed since (its `RENAMED`) under its name of now: a
    checkpoint's config.yaml is not the user's to edit (meta.json records its size and checksum)."""
    renamed, hints = getattr(cls, "RENAMED", {}), typing.get_type_hints(cls)
    now = {renamed.get(key, key): value for key, value in raw.items()}
    return {
        key: _keys_of_now(hints[key], value) if isinstance(value, Mapping) and is_dataclass(hints.get(key)) else value
        for key, value in now.items()
    }


def write_safetensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: Path,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write tensors as `model.safetensors`, or as HF shards + `model.safetensors.index.json`, streaming.

    Shards get temporary names until their count is known. Returns the file names written.
    """
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total_bytes = 0
    tmp_names: list[str] = []
    weight_map: dict[str, str] = {}

    def flush() -> None:
        name = f".shard-{len(tmp_names):05d}.tmp"
        save_file(pending, str(out_dir / name), metadata={"format": "pt"})
        tmp_names.append(name)
        weight_map.update(dict.fromkeys(pending, name))
        pending.clear()

    for key, tensor in tensors:
        tensor = (tensor.to(dtype) if dtype is not None else tensor).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + nbytes > max_shard_bytes:
            flush()
            pending_bytes = 0
        pending[key] = tensor
        pending_bytes += nbytes
        total_bytes += nbytes
    flush()
    if len(tmp_names) == 1:
        os.replace(out_dir / tmp_names[0], out_dir / "model.safetensors")
        return ["model.safetensors"]
    final = {tmp: f"model-{i + 1:05d}-of-{len(tmp_names):05d}.safetensors" for i, tmp in enumerate(tmp_names)}
    for tmp, name in final.items():
        os.replace(out_dir / tmp, out_dir / name)
    index = {
        "metadata": {"total_size": total_bytes},
        "weight_map": {key: final[tmp] for key, tmp in sorted(weight_map.items())},
    }
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
    return [*final.values(), "model.safetensors.index.json"]


def read_hf_weights(hf_dir: Path) -> SafetensorsState:
    """The weights of an HF model directory (safetensors only: pickled .bin files are never loaded)."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' of tensor names to files; the download is incomplete")
        shards = sorted(set(weight_map.values()))
        lacking = next((shard for shard in shards if not (hf_dir / shard).is_file()), None)
        if lacking is not None:
            raise FileNotFoundError(
                f"{hf_dir} lacks {lacking}, a shard its model.safetensors.index.json lists: the download is "
                "incomplete; fetch the model again (hf download <id> --local-dir ...) or copy the shard beside it"
            )
        return SafetensorsState(hf_dir / f for f in shards)
    single = hf_dir / "model.safetensors"
    if single.is_file():
        return SafetensorsState([single])
    extra = (
        " (pytorch_model.bin found: spes never unpickles weights; re-save it with safetensors)"
        if (hf_dir / "pytorch_model.bin").exists()
        else ""
    )
    raise FileNotFoundError(f"{hf_dir} has no model.safetensors or model.safetensors.index.json{extra}")


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from an HF directory; ValueError naming the file if it is not one."""
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); the download is incomplete or the file was edited") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: a JSON object was expected, not {type(loaded).__name__}")
    return loaded


def read_hf_config(
    hf_dir: Path, supported: Mapping[str, Any], *, elsewhere: Mapping[str, str] | None = None
) -> tuple[Any, Any]:
    """(transformers config, the matching entry of `supported`) of an HF directory, or a clear error; `elsewhere`
    maps a model_type another command takes (a dense model given to import, an MoE to upcycling) to what to run."""
    if not (hf_dir / "config.json").is_file():
        spes = (hf_dir / META_FILE).is_file() or (hf_dir / LATEST).is_file()
        raise FileNotFoundError(
            f"{hf_dir} is not a Hugging Face model directory: it has no config.json"
            + ("; it is a spes checkpoint: export it first (python -m spes.hf export --checkpoint ...)" if spes else "")
        )
    model_type = _read_json(hf_dir / "config.json").get("model_type", "")
    if model_type not in supported:
        instead = (elsewhere or {}).get(model_type)
        raise ValueError(
            f"{hf_dir}: model_type {model_type!r} is not supported here; expected one of {sorted(supported)}"
            + (f"; {instead.format(hf=hf_dir)}" if instead else "")
        )
    from transformers import AutoConfig  # optional dependency (pip install -e .[hf])

    return AutoConfig.from_pretrained(str(hf_dir), local_files_only=True), supported[model_type]


def copy_tokenizer(src: Path, dst: Path, *, vocab_size: int | None = None) -> None:
    """Copy a local tokenizer (a directory or a bare tokenizer.json) into `dst` as an HF tokenizer directory."""
    loaded = load_tokenizer(src)  # clear FileNotFoundError/ValueError if it is not a tokenizer
    if vocab_size is not None:
        check_vocab(loaded.vocab_size, vocab_size, None)
    dst.mkdir(parents=True, exist_ok=True)
    src_dir = loaded.path.parent
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, dst / name)
    if not (dst / "tokenizer_config.json").is_file():
        tokens = {
            "eos_token": loaded.tokenizer.id_to_token(loaded.eos_token_id),
            "pad_token": loaded.tokenizer.id_to_token(loaded.pad_token_id),
        }
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **tokens}
        (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def refuse_existing(target: Path, overwrite: bool, marker: str) -> None:
    """FileExistsError for a non-empty `target` unless `overwrite` (--overwrite): nothing is replaced unasked. Nor
    with it, when `target` is not what the command writes (no `marker` file in it) or holds folders it never writes
    (evaluation results, a run): `--overwrite` replaces the folder whole."""
    if target.is_file():
        raise FileExistsError(f"{target} is a file; choose another --out")
    if not target.exists() or not any(target.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(f"{target} already exists and is not empty; pass --overwrite to replace it")
    folders = sorted(p.name for p in target.iterdir() if p.is_dir())
    if folders:
        raise FileExistsError(
            f"{target} holds folders this command does not write ({', '.join(folders)}): --overwrite would delete "
            "them with it; move them out, or choose another --out"
        )
    if not (target / marker).is_file():
        raise FileExistsError(
            f"{target} is not a folder this command wrote (no {marker}): --overwrite would delete it whole; choose "
            "another --out"
        )


def _refuse_holding(target: Path, source: Path) -> None:
    """ValueError when `target` is `source` or a folder above it: --overwrite replaces `target` whole, so the export
    would delete the checkpoint it reads (or its whole save folder)."""
    target, source = Path(target).resolve(), Path(source).resolve()
    if target == source or target in source.parents:
        raise ValueError(
            f"--out {target} holds the checkpoint being exported ({source}): writing there would delete it; "
            f"choose another --out, e.g. {source.parent / 'hf' / source.name}"
        )


def _refuse_other_latest(out: Path) -> None:
    """ValueError when `out`'s folder is a run's save folder whose `latest` names another checkpoint: writing `out`
    there would make it the run's latest (a resume would start from it) and replace the run's tokenizer copy."""
    latest = out.parent / LATEST
    named = latest.read_text().strip() if latest.is_file() else out.name
    if named != out.name:
        raise ValueError(
            f"--out {out}: {out.parent} is a run's save folder (its latest is {named}); writing there would make "
            f"{out.name} its latest: choose a folder of its own, e.g. {out.parent / 'init' / out.name}"
        )


def write_step_dir(
    out: str | Path,
    state: Mapping[str, torch.Tensor],
    cfg: TrainConfig,
    *,
    tokenizer: Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `state` (fused experts) as the spes checkpoint `<save_folder>/step<N>` named by `out`.

    The experts are split into the config's blocks; the checkpoint has no optimizer or trainer state,
    so a run with `load_path` pointing at it starts at step 0 from these weights. A tokenizer is
    copied to `<save_folder>/tokenizer` and the config pointed at it.
    """
    out = Path(out).absolute()
    match = re.fullmatch(r"step(\d+)", out.name)
    if match is None:
        raise ValueError(f"--out {out} must be a checkpoint step directory named step<N>, e.g. output/<run_name>/step0")
    refuse_existing(out, overwrite, META_FILE)
    _refuse_other_latest(out)
    if tokenizer is not None:
        with staging_dir(out.parent / "tokenizer") as tmp:
            copy_tokenizer(tokenizer, tmp, vocab_size=cfg.model.vocab_size)
        cfg = replace(cfg, tokenizer=replace(cfg.tokenizer, identifier=str(out.parent / "tokenizer")))
    blocks = split_expert_blocks(state, cfg.experts_per_block)
    return save_checkpoint(
        out.parent,
        int(match.group(1)),
        model_state={k: v.float().contiguous() for k, v in blocks.items()},
        optim_state=None,
        trainer_state={},
        config=to_dict(cfg),
    )


def run_config_for(model: dict[str, Any], *, num_train_experts_per_node: int, run_name: str) -> TrainConfig:
    """A TrainConfig for a model imported from elsewhere, with experts stored in blocks of `num_train_experts_per_node`.

    Blocks smaller than E mean a SPES layout of ceil(E / num_train_experts_per_node) peers; E means one block
    (centralized). A run that starts from it may use its own layout.
    """
    num_experts = model["moe_num_experts"]
    if not 1 <= num_train_experts_per_node <= num_experts:
        raise ValueError(
            f"--num_train_experts_per_node must be in [1, {num_experts}] (the number of experts), "
            f"got {num_train_experts_per_node}"
        )
    spes = SpesConfig(
        num_peers=math.ceil(num_experts / num_train_experts_per_node),
        num_train_experts_per_node=num_train_experts_per_node,
    )
    return TrainConfig(
        run_name=run_name,
        save_folder=f"output/{run_name}",
        using_spes=num_train_experts_per_node < num_experts,
        model=ModelConfig(**model),
        spes_config=spes,
        tokenizer=TokenizerConfig(),
    )


# ---------------------------------------------------------------------------------------------------------------
# Commands


def export_checkpoint(
    step_dir: str | Path,
    out_dir: str | Path,
    *,
    tokenizer: str | Path | None = None,
    dtype: str = "float32",
    overwrite: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """spes checkpoint (a step directory, or a save folder meaning its latest) -> HF model directory."""
    step = resolve_checkpoint(step_dir)
    _refuse_holding(Path(out_dir), step)
    cfg = load_step_config(step)
    choose_family(cfg.model)  # refuse an unexportable model before reading any weights
    try:
        tok = resolve_tokenizer(tokenizer if tokenizer is not None else cfg.tokenizer.identifier)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"{err} (from config key 'tokenizer.identifier' of {step / 'config.yaml'}); pass "
            f"--tokenizer <dir> with the run's tokenizer"
        ) from None
    _check_trained_tokenizer(step, tok)
    return export_state(
        load_model_state(step),
        cfg.model,
        out_dir,
        tokenizer=tok,
        dtype=dtype,
        overwrite=overwrite,
        max_shard_bytes=max_shard_bytes,
    )


def _check_trained_tokenizer(step: Path, tokenizer: Path) -> None:
    """Warn when the tokenizer exported is not the one the run's shards were written with (the fingerprint the data
    loader's state records): a tokenizer of the same size but other ids passes every other check, and the model
    reads its text as other tokens."""
    trained = trainer_state(step).get("data", {}).get("tokenizer_fingerprint")
    exported = load_tokenizer(tokenizer)
    if trained and exported.fingerprint != trained:
        log.warning(
            f"warning: the tokenizer exported, {exported.path} (fingerprint {exported.fingerprint[:12]}), is not the "
            f"one the run's shards were written with ({trained[:12]}): pass --tokenizer with the run's tokenizer, "
            "unless this one is it saved again"
        )


def export_state(
    state: Mapping[str, torch.Tensor],
    m: ModelConfig,
    out_dir: str | Path,
    *,
    tokenizer: Path,
    dtype: str = "float32",
    overwrite: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """A spes model state dict (experts in blocks, as trained or stored) -> HF model directory `out_dir`."""
    family = choose_family(m)
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    import transformers  # optional dependency (pip install -e .[hf])

    config = getattr(transformers, family.config_class)(**hf_config_dict(family, m, dtype))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        yield from spes_to_hf(state, family.key_map(), m)
        for layer in range(m.n_layers):
            prefix = f"blocks.{layer}."
            part = fuse_expert_blocks({k: state[k] for k in state if k.startswith(prefix)})
            yield from spes_to_hf(part, family.key_map(), m, layer=layer)

    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    refuse_existing(out, overwrite, "config.json")
    with staging_dir(out) as tmp:
        copy_tokenizer(tokenizer, tmp, vocab_size=m.vocab_size)
        write_safetensors(tensors(), tmp, max_shard_bytes=max_shard_bytes, dtype=_DTYPES[dtype])
        config.save_pretrained(str(tmp))
    return out


def import_hf(
    hf_dir: str | Path, out: str | Path, *, num_train_experts_per_node: int | None = None, overwrite: bool = False
) -> Path:
    """HF OLMoE / Qwen3-MoE / Mixtral directory or Hub id -> spes checkpoint step directory (bit-exact in fp32)."""
    src = resolve(hf_dir, what="--hf")
    upcycle = (
        "it is a dense model: upcycle it with python -m spes.upcycle --hf {hf} --config <run.yaml> --out <dir>/step0"
    )
    hf_config, family = read_hf_config(src, FAMILIES, elsewhere=dict.fromkeys(DENSE_MODEL_TYPES, upcycle))
    has_tokenizer = (src / "tokenizer.json").is_file()
    vocab = load_tokenizer(src).vocab_size if has_tokenizer else None
    model = model_config_from_hf(family, hf_config, vocab_size=vocab)
    try:
        cfg = run_config_for(
            model,
            num_train_experts_per_node=(
                model["moe_num_experts"] if num_train_experts_per_node is None else num_train_experts_per_node
            ),
            run_name=f"import-{Path(hf_dir).absolute().name}",
        )
    except ConfigError as e:  # a value spes cannot take: the spes key it becomes, and where it came from
        attr = family.config_attr(e.key)
        source = f" (its '{attr}')" if attr else ""
        raise ConfigError(f"{src / 'config.json'}: importing it, {e}{source}", e.key) from None
    state = hf_to_spes(read_hf_weights(src), family.key_map(), cfg.model, architecture=family.architecture)
    return write_step_dir(out, state, cfg, tokenizer=src if has_tokenizer else None, overwrite=overwrite)
