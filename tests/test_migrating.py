"""A user of the first SPES implementation: its YAML files, defaults, data order and OLMo keys (docs/migrating.md).

tests/data/first_implementation/ holds test copies of its 11 config files (keys and values as there, data paths cut).
Each loads unchanged and resolves to what that implementation computed from it: the mode, the experts a node
trains, the node's data seed, its save folder, batch and model sizes. Where one of its files leaves a key out,
spes's default is that implementation's (or the key is unused by that file's run). Its centralized file trains
centralized; its start-from-weights keys and save_overwrite behave as OLMo's.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from data_fixtures import SAMPLE_TEXTS, write_documents
from spes.config import INERT_KEYS, TrainConfig, load_config
from spes.corpus import tokenize_main
from spes.distributed import DistInfo
from spes.node import build_node
from spes.shards import resolve_paths
from spes.tokenizer import LoadedTokenizer
from spes.train import main

REPO = Path(__file__).resolve().parents[1]
FIRST = Path(__file__).resolve().parent / "data" / "first_implementation"
TINY = str(REPO / "configs" / "tiny.yaml")
CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
SPES_1B = "spes_experiments/spes_moe_1b_slimpajama_100b_tokens_bsz256_4nodes/node_{}.yaml"
DILOCO_1B = "spes_experiments/dilico_fedavg_adamw_moe_1b_slimpajama_100b_tokens_bsz256_4nodes/node{}.yaml"
CENTRAL_1B = "spes_experiments/centralized_moe_1b_slimpajama_100b_tokens.yaml"


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What the first implementation computed from one of its files (its scripts/train.py and data loader)."""

    mode: str  # using_spes false: centralized; using_dilico: every node trains everything
    trained_experts: tuple[int, int] | None  # [p*k, min(p*k + k, E)) under SPES; None: all
    data_seed: int  # data.seed if set, else seed (no per-node offset)
    save_folder: str  # ${spes_config.peer_id} resolved against its schema's defaults (0)
    batch: tuple[int, int]  # global_train_batch_size, device_train_microbatch_size
    steps: int  # min(max_duration, stop_at)
    expert_width: int  # ffn_hidden_size of its MoE: mlp_hidden_size (or mlp_ratio * d_model) / 2
    kv_heads: int
    embedding_size: int


def _spes_1b(p: int) -> Resolved:
    folder = f"output/spes_moe_1b_slimpajama_100b_tokens_bsz256_4nodes/node{p}"
    return Resolved("spes", (4 * p, 4 * p + 4), 6198 + 1000 * p, folder, (1024, 8), 50000, 2048, 12, 151665)


def _diloco_1b(p: int) -> Resolved:
    folder = f"output/dilico_fedavg_adamw_moe_1b_slimpajama_100b_tokens_bsz256_4nodes/node{p}"
    return Resolved("diloco", None, 6198, folder, (256, 4), 50000, 2048, 12, 151665)


EXPECTED = {
    CENTRAL_1B: Resolved(
        "centralized",
        None,
        6198,
        "output/centralized_moe_1b_slimpajama_100b_tokens/node0",
        (1024, 4),
        50000,
        2048,
        12,
        151665,
    ),
    **{SPES_1B.format(p): _spes_1b(p) for p in range(4)},
    **{DILOCO_1B.format(p): _diloco_1b(p) for p in range(4)},
    "spes_experiments_scaling/spes_moe_1b_7b_4_nodes.yaml": Resolved(
        "spes", (0, 8), 6198, "output/spes_moe_1b_7b_4_nodes/node0", (1024, 2), 500000, 2048, 16, 151665
    ),
    "spes_experiments_scaling/spes_moe_3b_9b_4nodes_norm_router.yaml": Resolved(
        "spes", (0, 2), 6198, "output/spes_moe_3b_9b_4nodes_norm_router/node0", (256, 1), 200000, 6144, 8, 151936
    ),
}


def test_every_file_of_the_first_implementation_is_here() -> None:
    assert sorted(str(p.relative_to(FIRST)) for p in FIRST.rglob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_its_file_loads_unchanged_and_resolves_as_there(name: str) -> None:
    cfg, inert = load_config(FIRST / name)
    want = EXPECTED[name]
    assert set(inert) <= INERT_KEYS
    got = Resolved(
        cfg.mode,
        cfg.owned_experts(),
        cfg.data_seed,
        cfg.save_folder,
        (cfg.global_train_batch_size, cfg.device_train_microbatch_size),
        cfg.max_steps,
        cfg.model.expert_hidden_size,
        cfg.model.n_kv_heads or 0,
        cfg.model.embedding_size or 0,
    )
    assert got == want


def test_its_9b_model_options_and_diloco_settings_carry_over() -> None:
    nine = load_config(FIRST / "spes_experiments_scaling/spes_moe_3b_9b_4nodes_norm_router.yaml")[0]
    m = nine.model
    assert (m.d_model, m.n_layers, m.n_heads, m.mlp_hidden_size, m.rope_theta) == (2048, 28, 16, 12288, 1e6)
    assert m.attention_layer_norm_over_head and m.normalize_expert_weights_p == 1.0
    assert (nine.spes_config.num_peers, nine.experts_per_block, m.moe_num_experts, m.moe_top_k) == (8, 2, 8, 2)
    diloco = load_config(FIRST / DILOCO_1B.format(2))[0]
    assert (diloco.model.rope_theta, diloco.spes_config.sync_steps, diloco.distributed_strategy) == (32000, 50, "ddp")
    assert diloco.wandb is None  # its nodes 1-3 have the section commented out
    seven = load_config(FIRST / "spes_experiments_scaling/spes_moe_1b_7b_4_nodes.yaml")[0]
    assert seven.activation_checkpointing is None and seven.save_interval_unsharded is None
    assert [e["label"] for e in seven.evaluators][-2:] == ["basic_arithmetic", "arc_easy_ppl"]


# ---------------------------------------------------------------------------------------------------------------
# Defaults: the first implementation's, where its files leave a key out

REFERENCE_DEFAULTS: dict[str, Any] = {
    # Its schema's defaults (spes/config.py there), written in spes's terms where the meaning is the same.
    "activation_checkpointing": None,
    "data.seed": None,  # then `seed`
    "ddp.find_unused_params": False,
    "ddp.grad_sync_mode": "batch",
    "fsdp.precision": "pure",
    "fsdp.sharding_strategy": "FULL_SHARD",
    "fsdp.wrapping_strategy": None,
    "model.attention_layer_norm_over_head": False,
    "model.mlp_hidden_size": None,
    "model.mlp_ratio": 4,
    "model.moe_normalize_expert_weights": None,  # its False: no renormalization
    "model.n_kv_heads": None,
    "model.using_custom_moe_impl": False,
    "save_interval": 1000,
    "save_interval_ephemeral": None,
    "save_interval_unsharded": None,
    "save_num_checkpoints_to_keep": -1,
    "save_num_unsharded_checkpoints_to_keep": -1,
    "sharded_checkpointer": None,  # inert here (its torch_legacy)
    "spes_config.decayed_factor_update_steps": 500,
    "spes_config.num_peers": 5,
    "spes_config.num_train_experts_per_node": 1,
    "spes_config.peer_id": 0,
    "spes_config.server_addr": None,
    "spes_config.sync_steps": 100,
    "spes_config.using_decayed_aux_loss": False,
    "spes_config.quant_non_local_trainable_experts": False,
    "using_dilico": False,
    "using_spes": False,
    "try_load_latest_save": False,
    "reset_optimizer_state": False,
    "reset_trainer_state": False,
    "restore_dataloader": True,
    "time_limit": None,
    "scheduler.warmup_min_lr": None,
    "model.clip_qkv": None,
    "model.moe_shared_expert": False,
    "wandb.group": None,
    "wandb.log_interval": 1,
    "wandb.tags": ["watching"],
}


def _unused(key: str, cfg: TrainConfig) -> bool:
    """Keys a run of this mode never reads: fsdp.* outside FSDP, spes_config.* without a server, wandb.* without
    W&B (its section absent: None in both implementations)."""
    section = key.split(".")[0]
    return (
        (section == "fsdp" and cfg.distributed_strategy != "fsdp")
        or (section == "ddp" and cfg.distributed_strategy != "ddp")
        or (section == "spes_config" and not cfg.sync_enabled)
        or (section == "wandb" and cfg.wandb is None)
    )


def _default(key: str) -> Any:
    """spes's default of a dotted key (KeyError-free: StopIteration for a key spes does not have)."""
    cls: Any = TrainConfig
    *sections, name = key.split(".")
    for section in sections:
        hint = typing.get_type_hints(cls)[section]
        cls = next(t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t))
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def _keys(raw: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for k, v in raw.items():
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _keys(v, f"{prefix}{k}.")
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_key_its_file_leaves_out_takes_its_default(name: str) -> None:
    written = _keys(yaml.safe_load((FIRST / name).read_text()))
    cfg = load_config(FIRST / name)[0]
    differing = {
        key: (_default(key), ref)
        for key, ref in REFERENCE_DEFAULTS.items()
        if key not in written and not _unused(key, cfg) and _default(key) != ref and key != "sharded_checkpointer"
    }
    assert differing == {}, "spes default vs the first implementation's, for keys this file leaves out"


def test_every_default_that_differs_is_named_in_the_migration_guide() -> None:
    """Elsewhere spes's defaults differ where it cannot (or should not) follow OLMo's; the guide's table names each
    such key, and every one of the first implementation's files writes it (or its run does not read it)."""
    guide = (REPO / "docs" / "migrating.md").read_text()
    table = guide[guide.index("## Defaults that differ") :]
    named = set(re.findall(r"^\| `([\w.]+)` \|", table, flags=re.M))
    assert len(named) > 20, "the guide's table of defaults"
    for path in FIRST.rglob("*.yaml"):
        written, cfg = _keys(yaml.safe_load(path.read_text())), load_config(path)[0]
        for key in named:
            _default(key)  # a spes key
            assert key in written or _unused(key, cfg), (path.name, key)
    differing = {k for k, v in REFERENCE_DEFAULTS.items() if _default(k) != v and k != "sharded_checkpointer"}
    assert differing <= named


# ---------------------------------------------------------------------------------------------------------------
# Runs: its centralized file trains centralized; OLMo's start-from-weights keys; save_overwrite


def _tiny_model(corpus, folder: Path | str) -> list[str]:  # type: ignore[no-untyped-def]
    """Overrides that shrink a 1B file of the first implementation to the test corpus and a few CPU steps."""
    return [
        "--model.d_model=32",
        "--model.n_heads=2",
        "--model.n_layers=2",
        "--model.mlp_hidden_size=64",
        "--model.max_sequence_length=32",
        "--model.vocab_size=4096",
        "--model.embedding_size=4096",
        "--model.eos_token_id=0",
        "--model.pad_token_id=1",
        "--global_train_batch_size=8",
        "--device_train_microbatch_size=4",
        "--max_duration=3",
        "--stop_at=3",
        "--scheduler.t_warmup=2",
        "--scheduler.t_max=3",
        "--data.num_workers=0",
        "--evaluators=[]",
        "--wandb=null",
        f"--tokenizer.identifier={corpus.tokenizer}",
        *([f"--save_folder={folder}"] if folder else []),
    ]


def test_its_centralized_file_trains_centralized_on_its_headerless_token_files(
    tiny_corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    """No using_spes in the file: no server is contacted; its save_folder interpolates a section the file lacks; its
    data are flat uint32 memmaps named .npy (what its tokenize_data.py wrote), read with its memmap_dtype."""
    monkeypatch.chdir(tmp_path)
    flat = tmp_path / "SlimPajama-627B"
    flat.mkdir()
    for i, shard in enumerate(resolve_paths([str(tiny_corpus.train)])):
        np.load(shard).astype(np.uint32).tofile(flat / f"{i:03d}_000000.npy")
    assert main([str(FIRST / CENTRAL_1B), *_tiny_model(tiny_corpus, ""), f"--data.paths=[{flat}]"]) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "output/centralized_moe_1b_slimpajama_100b_tokens/node0"
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and not any("sync_s" in r for r in records)
    assert "data order seed 6198 (seed (data.seed unset))" in out
    assert "distributed_strategy=fsdp on one process: the model is not wrapped" in out
    assert "sharded_checkpointer" in out and "change nothing in spes" in out


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


@pytest.fixture
def first_run(tiny_corpus, tmp_path: Path) -> Path:  # type: ignore[no-untyped-def]
    """A finished 4-step centralized run of configs/tiny.yaml (its step-4 checkpoint holds optimizer state)."""
    folder = tmp_path / "first"
    args = [TINY, "--using_spes=false", *_tiny_corpus(tiny_corpus, folder), "--max_duration=4st", "--save_interval=4"]
    assert main(args) == 0
    return folder


def _tiny_corpus(corpus, folder: Path) -> list[str]:  # type: ignore[no-untyped-def]
    return [*corpus.overrides(folder), "--eval_interval=null", "--log_interval=1000"]


def _node(corpus, folder: Path, *extra: str):  # type: ignore[no-untyped-def]
    cfg, _ = load_config(TINY, ["--using_spes=false", *_tiny_corpus(corpus, folder), *extra])
    return cfg, build_node(cfg, CPU, log=lambda _m: None)


def test_the_upcycled_start_loads_weights_only(first_run: Path, tiny_corpus, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The first implementation's fresh-start branch: --reset_optimizer_state --reset_trainer_state
    --restore_dataloader=false --load_path=<init>: its weights, a fresh optimizer, step 0, the data from the start."""
    flags = ["--reset_optimizer_state=true", "--reset_trainer_state=true", "--restore_dataloader=false"]
    _, node = _node(tiny_corpus, tmp_path / "new", f"--load_path={first_run}", *flags)
    saved = _weights(first_run / "step4")
    state = node.model.state_dict()
    assert all(torch.equal(state[k], saved[k]) for k in saved)
    assert node.optimizer.state == {} and node.checkpoint is not None and node.checkpoint.trainer == {}
    assert main([TINY, "--using_spes=false", *_tiny_corpus(tiny_corpus, tmp_path / "new"), "--max_duration=2st",
                 f"--load_path={first_run}", "--log_interval=1", *flags]) == 0  # fmt: skip
    assert [json.loads(r)["step"] for r in (tmp_path / "new" / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_reset_optimizer_state_alone_keeps_the_step_and_warms_the_learning_rate_up_again(
    first_run: Path, tiny_corpus, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """OLMo's bolt-on warm-up: from 0 at the loaded step to the schedule's value t_warmup steps later."""
    flags = [f"--load_path={first_run}", "--reset_optimizer_state=true", "--max_duration=12st"]
    cfg, node = _node(tiny_corpus, tmp_path / "new", *flags)
    assert node.optimizer.state == {} and node.checkpoint is not None
    assert node.checkpoint.trainer["step"] == 4 and node.checkpoint.trainer["lr_rewarm"] == [4, 4 + 5]
    assert (
        main([TINY, "--using_spes=false", *_tiny_corpus(tiny_corpus, tmp_path / "new"), *flags, "--log_interval=1"])
        == 0
    )
    lines = (tmp_path / "new" / "metrics.jsonl").read_text().splitlines()
    records = {json.loads(r)["step"]: json.loads(r) for r in lines}
    assert sorted(records) == list(range(5, 13))
    from spes.optim import lr_at
    from spes.trainer import schedule_length

    def schedule(step: int) -> float:
        return lr_at(step, cfg.scheduler, cfg.optimizer.learning_rate, schedule_length(cfg))

    assert records[5]["lr"] == pytest.approx(schedule(9) * 1 / 5)
    assert records[8]["lr"] == pytest.approx(schedule(9) * 4 / 5)
    assert records[10]["lr"] == pytest.approx(schedule(10))


def test_restore_dataloader_false_keeps_the_optimizer_and_starts_the_data_and_step_at_zero(
    first_run: Path, tiny_corpus, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    _, node = _node(tiny_corpus, tmp_path / "new", f"--load_path={first_run}", "--restore_dataloader=false")
    assert node.optimizer.state != {} and node.checkpoint is not None
    assert set(node.checkpoint.trainer) == {"rng"}


def test_save_overwrite_guards_another_runs_saves(
    first_run: Path, tiny_corpus, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    """A fresh start into a folder holding a run's checkpoints and metrics is refused, naming the folder; a resume
    is not a fresh start; save_overwrite=true replaces the old run (its later checkpoints would outrank the new)."""
    again = [
        TINY,
        "--using_spes=false",
        *_tiny_corpus(tiny_corpus, first_run),
        "--max_duration=2st",
        "--log_interval=1",
    ]
    assert main(again) == 2
    err = capsys.readouterr().err
    saves = "(step4, metrics.jsonl, latest): continue that run with --resume"
    assert f"error: save_folder {first_run} already holds a run's saves {saves}" in err
    assert "set save_overwrite=true" in err
    assert main([*again, "--max_duration=5st", "--resume"]) == 0
    assert main([*again, "--save_overwrite=true"]) == 0
    assert "save_overwrite: removed the earlier run's saves" in capsys.readouterr().out
    assert sorted(p.name for p in first_run.glob("step*")) == ["step2"]
    assert len((first_run / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_save_folder_that_cannot_be_one_fails_before_the_model_is_built(  # type: ignore[no-untyped-def]
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    args = [TINY, "--using_spes=false", *_tiny_corpus(tiny_corpus, afile), "--max_duration=2st"]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert err == f"error: save_folder {afile} is a file, not a folder; choose another save_folder (or run_name)\n"
    assert "parameters:" not in out  # the model was not built
    monkeypatch.setattr("spes.node.os.access", lambda path, mode: path != tmp_path)  # root may write anywhere
    args = [TINY, "--using_spes=false", *_tiny_corpus(tiny_corpus, tmp_path / "new" / "run"), "--max_duration=2st"]
    assert main(args) == 2
    assert capsys.readouterr().err == (
        f"error: save_folder {tmp_path / 'new' / 'run'}: {tmp_path} is not writable here; choose another save_folder\n"
    )


def test_time_limit_saves_and_stops_and_dry_run_trains_nothing(tiny_corpus, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    args = [TINY, "--using_spes=false", *_tiny_corpus(tiny_corpus, tmp_path / "run"), "--max_duration=50st"]
    assert main([*args, "--time_limit=0.001", "--save_interval=null"]) == 0
    assert (tmp_path / "run" / "latest").read_text().strip() == "step1"
    assert main([*args, "--dry_run=true", f"--save_folder={tmp_path / 'dry'}"]) == 0
    assert not (tmp_path / "dry").exists()


@pytest.mark.timeout(300)  # NOTE: each evaluators check runs lm-eval's task index in a process: 40 s each under load
def test_a_dry_run_checks_what_a_start_checks_and_writes_nothing(  # type: ignore[no-untyped-def]
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run spec (a SPES node's codec settings), and the evaluators' tasks, as a real start checks them: not in
    the save folder, and without asking the server."""
    args = [TINY, *_tiny_corpus(tiny_corpus, tmp_path / "dry"), "--dry_run=true", "--spes_config.server_addr=h:1"]
    assert main([*args, "--spes_config.codec_settings.zip=1"]) == 2
    assert "error: unknown config key 'spes_config.codec_settings.zip'; the fp32 codec takes none" in (
        capsys.readouterr().err
    )
    assert main([*args, "--evaluators=[{label: nosuchtask}, {label: piqa_typo}]", "--eval_interval=5"]) == 2
    assert capsys.readouterr().err.endswith(
        "error: config key 'evaluators' names tasks lm-eval does not have: nosuchtask, piqa_typo; check their "
        "spelling (python -m lm_eval --tasks list names them all)\n"
    )
    assert main([*args, "--evaluators=[{label: piqa}]", "--eval_interval=5"]) == 0
    out = capsys.readouterr().out
    assert (
        "left out of this run: piqa (no data set" in out and "checked its save folder, run spec and evaluators" in out
    )
    np.save(tmp_path / "short.npy", np.arange(10, dtype=np.uint16))  # not one window: every loss would read 0
    assert main([*args, f"--data.validation_paths=[{tmp_path / 'short.npy'}]", "--eval_interval=5"]) == 2
    assert capsys.readouterr().err.endswith(
        "error: data.validation_paths hold no sequence of 64 tokens: add validation data, or set "
        "data.validation_paths=[] to train without validation\n"
    )
    assert not (tmp_path / "dry").exists()
    (tmp_path / "dry").mkdir()  # a save folder of another run: refused as a start refuses it; overwritten, kept
    (tmp_path / "dry" / "metrics.jsonl").write_text("{}\n")
    assert main(args) == 2
    assert "error: save_folder " in capsys.readouterr().err
    assert main([*args, "--save_overwrite=true"]) == 0
    assert "dry run: save_overwrite would remove the earlier run's saves" in capsys.readouterr().out
    assert (tmp_path / "dry" / "metrics.jsonl").read_text() == "{}\n"


# ---------------------------------------------------------------------------------------------------------------
# Data: the guide's tokenize command and the listing after it


def _data_commands() -> tuple[list[str], list[str]]:
    """The guide's tokenize command's arguments and its list_processed_files.sh command (the block under "## Data")."""
    section = (REPO / "docs" / "migrating.md").read_text().split("\n## Data\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    tokenize, listing = (shlex.split(line) for line in block.splitlines())
    return tokenize[2:], listing


@pytest.mark.timeout(120)
def test_the_guides_tokenize_command_writes_the_shards_the_next_command_lists(
    tokenizer: LoadedTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its `--output_prefix tokenized/tokenized_` wrote tokenized__00000.npy (spes adds `_00000.npy`): the guide's
    prefix names the shards as spes names its own, and its listing then names them. Run from a scratch folder as
    written, but for the input, a local tokenizer and 2 processes (this machine's)."""
    args, listing = _data_commands()
    machine = {"--file_glob": "raw/*.jsonl", "--tokenizer_name_or_path": str(tokenizer.path.parent), "--processes": "2"}
    for flag, value in machine.items():
        args[args.index(flag) + 1] = value
    prefix = args[args.index("--output_prefix") + 1]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "raw").mkdir()
    write_documents(tmp_path / "raw" / "a.jsonl", SAMPLE_TEXTS)
    assert tokenize_main(args) == 0
    shards = sorted(str(p) for p in tmp_path.glob("tokenized/*.npy"))
    named = re.escape(str(tmp_path / prefix)) + r"_\d{5}\.npy"
    assert shards and all(re.fullmatch(named, p) and "__" not in Path(p).name for p in shards), shards
    assert listing[:2] == ["bash", "data_process_scripts/list_processed_files.sh"]
    done = subprocess.run(
        ["bash", str(REPO / listing[1]), *listing[2:]], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / listing[3]).read_text().splitlines() == shards
