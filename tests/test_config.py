"""Tests of spes.config: every shipped YAML loads, interpolation and `--section.key=value` overrides work,
user mistakes are reported by key, and a config file of the first SPES implementation loads unchanged."""

from __future__ import annotations

import dataclasses
import re
import textwrap
import typing
from pathlib import Path

import pytest
import yaml

from spes.config import (
    INERT_KEYS,
    InstanceFilterConfig,
    ModelConfig,
    SpesConfig,
    TrainConfig,
    changed_settings,
    load_config,
    load_sync_sections,
    node_data_seed,
    parse_duration,
    passed_over,
    run_data_seed,
)
from spes.schema import ConfigError, _yaml_problem, config_help, from_dict, to_dict

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHIPPED = sorted(CONFIGS.rglob("*.yaml"))


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# ---------------------------------------------------------------------------------------------------------------
# Shipped configs


def test_configs_are_shipped() -> None:
    names = {str(p.relative_to(CONFIGS)) for p in SHIPPED}
    expected = {"tiny.yaml", "small.yaml", "centralized_1b.yaml"}
    expected |= {f"{family}/node_{n}.yaml" for family in ("spes_1b", "diloco_1b") for n in range(4)}
    assert expected <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_shipped_config_loads_and_validates(path: Path) -> None:
    cfg, inert = load_config(path)
    assert isinstance(cfg, TrainConfig)
    assert "${" not in cfg.save_folder  # interpolation resolved
    assert inert == [], f"{path.name} sets keys that change nothing: {inert}"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_shipped_config_comments_every_key(path: Path) -> None:
    for number, line in enumerate(path.read_text().splitlines(), 1):
        key_with_value = re.match(r"^\s*[A-Za-z_]\w*:\s*[^\s#]", line)
        if key_with_value and "#" not in line:
            pytest.fail(f"{path.name}:{number}: key without a comment (meaning, type, default): {line.strip()}")


@pytest.mark.parametrize("family", ["spes_1b", "diloco_1b", "upcycled_9b"])
def test_node_files_differ_only_in_peer_id_and_data_seed(family: str) -> None:
    """Each node reads the data in its own order: its file carries its own data.seed, 6198 + 1000 * id, as the
    first implementation's node files."""
    paths = sorted((CONFIGS / family).glob("node_*.yaml"))
    configs = [load_config(path)[0] for path in paths]
    for n, cfg in enumerate(configs):
        assert cfg.spes_config.peer_id == n and cfg.data.seed == cfg.data_seed == node_data_seed(6198, n)
        assert cfg.save_folder == f"output/{cfg.run_name}/node{n}"
        same = dataclasses.replace(
            cfg, spes_config=configs[0].spes_config, save_folder=configs[0].save_folder, data=configs[0].data
        )
        assert same == configs[0]
        assert dataclasses.replace(cfg.data, seed=6198) == configs[0].data


def test_a_node_reads_in_the_order_of_its_data_seed_else_of_seed(tmp_path: Path) -> None:
    """The first implementation's rule: data.seed as given (no per-peer offset on top), `seed` when it is unset."""
    cfg, _ = load_config(write(tmp_path, "data:\n  seed: 5\nspes_config:\n  peer_id: 3\n"))
    assert (cfg.data.seed, cfg.data_seed) == (5, 5)
    assert load_config(CONFIGS / "tiny.yaml", ["--data.seed=100", "--spes_config.peer_id=1"])[0].data_seed == 100
    assert load_config(write(tmp_path, "seed: 42\n"))[0].data_seed == 42
    assert [node_data_seed(6198, p) for p in range(4)] == [6198, 7198, 8198, 9198]


@pytest.mark.parametrize("family", ["spes_1b", "diloco_1b", "upcycled_9b"])
def test_from_any_node_file_every_node_gets_its_own_files_data_seed(family: str) -> None:
    """A launcher started from node_k.yaml gives node n the seed of node_n.yaml: the run's, not node_k's + 1000 n."""
    paths = sorted((CONFIGS / family).glob("node_*.yaml"))
    configs = [load_config(path)[0] for path in paths]
    own = [cfg.data_seed for cfg in configs]
    for cfg in configs:
        assert [run_data_seed(cfg, n) for n in range(len(configs))] == own


def test_a_data_seed_that_implies_no_run_seed_is_refused(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "data:\n  seed: 5\nspes_config:\n  peer_id: 1\n  num_peers: 2\n"))[0]
    assert run_data_seed(cfg, 1) == 5  # its own, as given
    with pytest.raises(ConfigError) as err:
        run_data_seed(cfg, 0)
    assert str(err.value) == (
        "config key 'data.seed' = 5 of spes_config.peer_id=1 implies no seed for node 0 (it is not 1000 * 1 + a "
        "run's seed): launch from node 0's YAML, or give the node its data.seed"
    )
    assert err.value.key == "data.seed"
    edge = load_config(write(tmp_path, "data:\n  seed: 1000\nspes_config:\n  peer_id: 1\n  num_peers: 2\n"))[0]
    assert run_data_seed(edge, 0) == 0  # the run's seed 0, the smallest there is


# ---------------------------------------------------------------------------------------------------------------
# The parameter server's section


def test_the_server_section_loads_with_the_run(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        using_spes: true
        using_dilico: true
        server:
          outer_optimizer: nesterov
          outer_lr: 0.5
          dead_peer_policy: quorum
          min_peers: 3
        """,
    )
    cfg, _ = load_config(path, ["--server.merge_interval=20", "--server.round_timeout_s=60"])
    s = cfg.server
    assert (s.outer_optimizer, s.outer_lr, s.dead_peer_policy, s.min_peers) == ("nesterov", 0.5, "quorum", 3)
    assert (s.merge_interval, s.round_timeout_s, s.merge_alpha_start) == (20, 60.0, 0.01)
    assert cfg.mode == "diloco"


@pytest.mark.parametrize(
    ("text", "overrides", "expected"),
    [
        (
            "server:\n  merge_intervall: 5\n",
            [],
            "unknown config key 'server.merge_intervall'; did you mean 'server.merge_interval'?",
        ),
        ("", ["--server.merge_topk=0"], "config key 'server.merge_topk' = 0 must be >= 1"),
        (
            "",
            ["--server.outer_optimizer=adam"],
            "'server.outer_optimizer' = 'adam' must be one of ['none', 'nesterov']",
        ),
        (
            "",
            ["--using_spes=true", "--server.min_peers=5"],
            "config key 'server.min_peers' = 5 must be <= spes_config.num_peers=4",
        ),
        ("", ["--server.merge_decay_steps=abc"], "command line (--server.merge_decay_steps=abc)"),
    ],
)
def test_server_section_mistakes_name_the_key(tmp_path: Path, text: str, overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(write(tmp_path, text or "{}\n"), overrides)


def test_an_outer_optimizer_in_a_spes_run_is_refused(tmp_path: Path) -> None:
    """The outer Nesterov step is DiLoCo's: a SPES round would not apply it, so asking for it is an error naming the
    key, from the run's YAML and from a server's command line alike (issue 30)."""
    expected = "config key 'server.outer_optimizer' = 'nesterov' applies to DiLoCo runs only (using_dilico: true)"
    with pytest.raises(ConfigError, match=re.escape(expected)) as err:
        load_config(CONFIGS / "tiny.yaml", ["--server.outer_optimizer=nesterov"])
    assert str(err.value).endswith("this run is spes: set server.outer_optimizer=none") and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_sync_sections(["--server.outer_optimizer=nesterov"])
    cfg, _ = load_config(CONFIGS / "tiny.yaml", ["--using_dilico=true", "--server.outer_optimizer=nesterov"])
    assert cfg.server.outer_optimizer == "nesterov"
    assert load_sync_sections(["--using_dilico=true", "--server.outer_optimizer=nesterov"])[1].outer_optimizer == (
        "nesterov"
    )


def test_dilico_without_spes_is_refused_before_any_work(tmp_path: Path) -> None:
    """using_dilico asks for a parameter server and using_spes: false for none: whichever won, the run would be a
    baseline other than the one the file names, so the pair is refused naming the key and both ways out, from a
    node's YAML, its command line and a server's command line alike."""
    expected = (
        "config key 'using_dilico' = True asks for the DiLoCo baseline, which meets a parameter server, but "
        "using_spes is false (no server): set using_spes=true for DiLoCo (as configs/diloco_1b does), or "
        "using_dilico=false for centralized training"
    )
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "using_dilico: true\nusing_spes: false\n"))
    assert str(err.value).endswith(expected) and "\n" not in str(err.value)
    assert refusal(CONFIGS / "diloco_1b" / "node_0.yaml", "--using_spes=false") == (
        f"command line (--using_spes=false): {expected}"
    )
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_sync_sections(["--using_spes=false", "--using_dilico=true"])
    assert load_config(CONFIGS / "tiny.yaml", ["--using_dilico=true"])[0].mode == "diloco"


def test_help_lists_the_server_keys() -> None:
    lines = config_help(TrainConfig)
    for key in (
        "merge_interval=500",
        "merge_alpha_start=0.01",
        "merge_decay_steps=10000",
        "outer_optimizer='none'",
        "dead_peer_policy='wait'",
        "round_timeout_s=3600.0",
    ):
        assert any(line.strip().startswith(f"--server.{key}") for line in lines), key


def test_a_server_without_the_run_takes_its_sync_sections_from_overrides() -> None:
    """A server started without the run's YAML (the first implementation's habit) knows no model: it takes the
    spes_config and server sections and the mode from --key=value overrides alone."""
    spes, section, mode = load_sync_sections(
        ["--server.merge_interval=7", "--server.dead_peer_policy=quorum", "--spes_config.num_peers=3"]
    )
    assert (section.merge_interval, section.dead_peer_policy, section.merge_topk, spes.num_peers) == (7, "quorum", 4, 3)
    assert mode == "spes" and load_sync_sections(["--using_dilico=true"])[2] == "diloco"
    with pytest.raises(ConfigError, match=r"only --spes_config.\*, --server.\*, --using_spes and --using_dilico apply"):
        load_sync_sections(["--model.d_model=64"])
    with pytest.raises(ConfigError, match="did you mean 'server.merge_topk'"):
        load_sync_sections(["--server.merge_top=2"])
    assert load_sync_sections(["--using_spes=false"])[2] == "centralized"
    assert load_sync_sections(["--using_spes=true", "--using_dilico=false"])[2] == "spes"
    with pytest.raises(ConfigError) as err:
        load_sync_sections(["--model.d_model=64"])
    assert str(err.value) == (
        "command line (--model.d_model=64): without the run's YAML only --spes_config.*, --server.*, --using_spes "
        "and --using_dilico apply; give the run's YAML first (python -m spes.server RUN.yaml ...)"
    )
    with pytest.raises(ConfigError, match="^command line: config key 'server.merge_topk' = 0 must be >= 1$"):
        load_sync_sections(["--server.merge_topk=0"])  # (spes_config's bounds are the run spec's: test_spec)


def test_paper_1b_config_values() -> None:
    cfg = load_config(CONFIGS / "spes_1b" / "node_0.yaml")[0]
    m, s = cfg.model, cfg.spes_config
    assert (m.d_model, m.n_heads, m.n_layers, m.mlp_hidden_size, m.expert_hidden_size) == (768, 12, 12, 4096, 2048)
    assert (m.moe_num_experts, m.moe_top_k, m.max_sequence_length, m.rope_theta) == (16, 2, 2048, 500000.0)
    assert (m.vocab_size, m.embedding_size, m.attention_layer_norm) == (151665, 151936, True)
    assert (m.init_std, m.init_cutoff_factor, m.moe_zloss_weight, m.moe_loss_weight) == (0.02, 3.0, 0.001, 0.01)
    assert (s.num_peers, s.num_train_experts_per_node, s.sync_steps) == (4, 4, 100)
    assert cfg.owned_experts() == (0, 4) and cfg.precision == "amp_bf16" and cfg.distributed_strategy == "fsdp"
    assert cfg.optimizer.betas == [0.9, 0.95] and cfg.scheduler.name == "cosine_with_warmup"
    diloco = load_config(CONFIGS / "diloco_1b" / "node_0.yaml")[0]
    assert diloco.using_dilico and diloco.sync_enabled and diloco.owned_experts() is None
    central = load_config(CONFIGS / "centralized_1b.yaml")[0]
    assert not central.sync_enabled and central.owned_experts() is None
    assert central.global_train_batch_size == 4 * cfg.global_train_batch_size


# ---------------------------------------------------------------------------------------------------------------
# Interpolation and overrides


def test_interpolation_follows_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        run_name: demo
        save_folder: output/${run_name}/node${spes_config.peer_id}
        wandb:
          name: ${run_name}-wandb
        spes_config:
          peer_id: 0
    """,
    )
    cfg, _ = load_config(path)
    assert cfg.save_folder == "output/demo/node0" and cfg.wandb is not None and cfg.wandb.name == "demo-wandb"
    cfg, _ = load_config(path, ["--spes_config.peer_id=3", "--run_name=other"])
    assert cfg.save_folder == "output/other/node3" and cfg.wandb is not None and cfg.wandb.name == "other-wandb"


def test_save_folder_defaults_to_the_run_name(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "run_name: abc\n"))[0].save_folder == "output/abc"


def test_a_save_folder_or_load_path_from_home_is_the_home_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shell leaves --save_folder=~/runs as written: training wrote into a folder named ~ where it ran, while
    preflight checked the home folder's disk."""
    monkeypatch.setenv("HOME", str(tmp_path / "home ü"))
    cfg, _ = load_config(CONFIGS / "tiny.yaml", ["--save_folder=~/runs ü/a", "--load_path=~/w/step3"])
    assert (cfg.save_folder, cfg.load_path) == (f"{tmp_path}/home ü/runs ü/a", f"{tmp_path}/home ü/w/step3")
    assert load_config(CONFIGS / "tiny.yaml")[0].save_folder == "output/spes_tiny/node0"  # relative as written


def test_overrides_are_typed(tmp_path: Path) -> None:
    cfg, _ = load_config(
        CONFIGS / "tiny.yaml",
        [
            "--model.d_model=128",
            "--model.n_heads=8",
            "--optimizer.betas=[0.8,0.99]",
            "--optimizer.learning_rate=1e-3",
            "--spes_config.server_addr=10.0.0.7:6000",
            "--data.paths=[a.npy,shards/*.npy]",
            "--data.seed=7198",
            "--max_duration=2e6T",
            "--eval_interval=null",
            "--model.n_kv_heads=2",
        ],
    )
    assert cfg.model.d_model == 128 and cfg.model.n_heads == 8 and cfg.model.n_kv_heads == 2
    assert cfg.optimizer.betas == [0.8, 0.99] and cfg.optimizer.learning_rate == 1e-3
    assert cfg.spes_config.server_addr == "10.0.0.7:6000" and cfg.data.paths == ["a.npy", "shards/*.npy"]
    assert cfg.data.seed == 7198 and cfg.max_duration == "2e6T" and cfg.eval_interval is None


def test_overrides_without_a_file() -> None:
    cfg, _ = load_config(
        None, ["--using_spes=true", "--model.moe_num_experts=8", "--spes_config.num_train_experts_per_node=2"]
    )
    assert cfg.owned_experts() == (0, 2) and cfg.experts_per_block == 2


def test_override_must_have_a_value() -> None:
    with pytest.raises(ConfigError, match=r"--model\.d_model.*--section\.key=value"):
        load_config(CONFIGS / "tiny.yaml", ["--model.d_model"])


def test_missing_file() -> None:
    with pytest.raises(FileNotFoundError, match="no_such.yaml"):
        load_config("no_such.yaml")


# ---------------------------------------------------------------------------------------------------------------
# Mistakes a user can make


@pytest.mark.parametrize(
    ("yaml_text", "wrong", "suggested"),
    [
        ("model:\n  d_modle: 64\n", "model.d_modle", "'model.d_model'"),
        ("sav_folder: out\n", "sav_folder", "'save_folder'"),
        ("spes_config:\n  sync_step: 10\n", "spes_config.sync_step", "'spes_config.sync_steps'"),
        ("data:\n  seeds: 1\n", "data.seeds", "'data.seed'"),
        # in another section (or in none): the keys of the whole config that end the same, or closest to it
        ("learning_rate: 0.001\n", "learning_rate", "'optimizer.learning_rate'"),
        ("model:\n  learning_rate: 0.001\n", "model.learning_rate", "'optimizer.learning_rate'"),
        ("optimizer:\n  t_warmup: 10\n", "optimizer.t_warmup", "'scheduler.t_warmup'"),
    ],
)
def test_unknown_key_in_file_names_the_closest_valid_key(
    tmp_path: Path, yaml_text: str, wrong: str, suggested: str
) -> None:
    path = write(tmp_path, yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: unknown config key '{wrong}'; did you mean {suggested}?"


def test_a_numeric_key_in_file_is_an_unknown_key(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  2: 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'model.2'"):
        load_config(path)


def test_a_text_key_takes_its_override_as_written() -> None:
    """OmegaConf reads a bare value as YAML: a run id of hex digits like `66e7320945644684` (what the server makes,
    and spes.launch passes on at a resume) was the float inf, and the run refused its own id."""
    cfg, _ = load_config(
        CONFIGS / "tiny.yaml",
        ["--spes_config.run_id=66e7320945644684", "--run_name=0123", "--wandb.entity=it's"],
    )
    assert (cfg.spes_config.run_id, cfg.run_name) == ("66e7320945644684", "0123")
    assert cfg.wandb is not None and cfg.wandb.entity == "it's"
    assert load_config(CONFIGS / "tiny.yaml", ["--spes_config.run_id=null"])[0].spes_config.run_id is None
    assert load_sync_sections(["--spes_config.run_id=1e5"])[0].run_id == "1e5"
    # quoted already, null, an interpolation: read as YAML reads them
    for text, value in [("'0123'", "0123"), ('"0123"', "0123"), ("~", None), ("x${run_name}", "xspes_tiny")]:
        assert load_config(CONFIGS / "tiny.yaml", [f"--spes_config.run_id={text}"])[0].spes_config.run_id == value
    for text, given in [("[a, b]", "['a', 'b']"), ("{a: 1}", "{'a': 1}")]:  # a list or mapping: not text
        with pytest.raises(ConfigError) as refused:
            load_config(CONFIGS / "tiny.yaml", [f"--spes_config.run_id={text}"])
        assert str(refused.value) == (
            f"command line (--spes_config.run_id={text}): config key 'spes_config.run_id' = {given} has the wrong "
            "type: expected str | None"
        )


@pytest.mark.parametrize(
    ("override", "wrong", "suggested"),
    [
        ("--spes_config.peer_ID=1", "spes_config.peer_ID", "'spes_config.peer_id'"),
        ("--model.moe_topk=4", "model.moe_topk", "'model.moe_top_k'"),
        ("--zzzzzzzz=1", "zzzzzzzz", None),
        # in another section (or in none): the keys of the whole config that end the same, or closest to it
        ("--learning_rate=1e-3", "learning_rate", "'optimizer.learning_rate'"),
        ("--spes.peer_id=1", "spes", "'spes_config.peer_id'"),
        ("--model.learnig_rate=1e-3", "model.learnig_rate", "'optimizer.learning_rate'"),
        ("--optimizer.log_dir=tb", "optimizer.log_dir", "'tensorboard.log_dir'"),  # an optional section's too
        ("--model.seed=1", "model.seed", "'seed' or 'data.seed'"),
        (  # a key two sections deep, by its last part
            "--repetition_max_periodd=5",
            "repetition_max_periodd",
            "'data.instance_filter.repetition_max_period'",
        ),
    ],
)
def test_unknown_key_in_override(override: str, wrong: str, suggested: str | None) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "tiny.yaml", [override])
    message = str(err.value)
    assert message.startswith(f"command line ({override}): unknown config key '{wrong}'; ")
    assert message.endswith(f"; did you mean {suggested}?") if suggested else ("; valid keys here: run_name" in message)


@pytest.mark.parametrize(
    ("yaml_text", "key", "value", "expected"),
    [
        ("model:\n  n_layers: two\n", "model.n_layers", "'two'", "int"),
        ("model:\n  n_layers: 2.5\n", "model.n_layers", "2.5", "int"),
        ("using_spes: 'yes'\n", "using_spes", "'yes'", "bool"),
        ("optimizer:\n  betas: 0.9\n", "optimizer.betas", "0.9", "list[float]"),
        ("optimizer:\n  betas: [0.9, high]\n", "optimizer.betas[1]", "'high'", "float"),
        ("spes_config:\n  server_addr: 50051\n", "spes_config.server_addr", "50051", "str"),
        ("model: 5\n", "model", "5", "ModelConfig"),
    ],
)
def test_wrong_type_names_key_value_and_expected_type(
    tmp_path: Path, yaml_text: str, key: str, value: str, expected: str
) -> None:
    path = write(tmp_path, yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message and f"'{key}' = {value}" in message and f"expected {expected}" in message


@pytest.mark.parametrize(
    ("yaml_text", "key", "value", "value_of_the_wrong_override"),
    [
        ("precision: fp16\n", "precision", "'fp16'", "['fp32', 'amp_bf16']"),
        ("model:\n  moe_backend: cuda\n", "model.moe_backend", "'cuda'", "'grouped_mm'"),
        ("spes_config:\n  codec: int4\n", "spes_config.codec", "'int4'", "['fp32', 'bf16', 'int8', 'sparse']"),
    ],
)
def test_choice_outside_the_allowed_values(
    tmp_path: Path, yaml_text: str, key: str, value: str, value_of_the_wrong_override: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, yaml_text))
    assert f"'{key}' = {value} must be one of" in str(err.value) and value_of_the_wrong_override in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "key", "hint"),
    [
        (["--model.d_model=66"], "model.d_model", "divisible by model.n_heads=4"),
        (["--model.d_model=68"], "model.d_model", "d_model / n_heads must be even for RoPE"),
        (["--model.n_kv_heads=3"], "model.n_kv_heads", "must divide model.n_heads=4"),
        (["--model.embedding_size=4000"], "model.embedding_size", ">= model.vocab_size=4096"),
        (["--model.moe_top_k=9"], "model.moe_top_k", "moe_num_experts=8"),
        (["--model.mlp_hidden_size=129"], "model.mlp_hidden_size", "must be even"),
        (["--model.weight_tying=true"], "model.weight_tying", "not supported"),
        (["--spes_config.num_train_experts_per_node=1"], "model.moe_num_experts", "num_train_experts_per_node=2"),
        (["--model.moe_num_experts=16"], "model.moe_num_experts", "num_peers=4 x num_train_experts_per_node=2"),
        (["--global_train_batch_size=20"], "global_train_batch_size", "device_train_microbatch_size=8"),
        (["--device_train_microbatch_size=0"], "device_train_microbatch_size", "> 0"),
        (["--spes_config.peer_id=4"], "spes_config.peer_id", "[0, num_peers=4)"),
        (["--spes_config.peer_id=-1"], "spes_config.peer_id", "[0, num_peers=4)"),
        (["--spes_config.server_addr=localhost"], "spes_config.server_addr", "host:port"),
        (["--spes_config.sync_steps=0"], "spes_config.sync_steps", ">= 1"),
        (["--spes_config.overlap_steps=11"], "spes_config.overlap_steps", "must be in [0, 10] (sync_steps / overlap"),
        (["--spes_config.overlap_steps=-1"], "spes_config.overlap_steps", "must be in [0, 10]"),
        (
            ["--spes_config.overlap_sync=true", "--spes_config.overlap_fragments=5", "--spes_config.overlap_steps=3"],
            "spes_config.overlap_steps",
            "must be in [0, 2] (sync_steps / overlap_fragments)",
        ),
        (["--spes_config.overlap_fragments=2"], "spes_config.overlap_fragments", "needs spes_config.overlap_sync=true"),
        (
            ["--spes_config.overlap_sync=true", "--spes_config.overlap_fragments=3"],
            "spes_config.overlap_fragments",
            "divide sync_steps=10",
        ),
        (["--spes_config.overlap_fragments=0"], "spes_config.overlap_fragments", "must be >= 1"),
        (["--spes_config.overlap_correction=0"], "spes_config.overlap_correction", "must be in (0, 1]"),
        (["--spes_config.overlap_correction=1.5"], "spes_config.overlap_correction", "must be in (0, 1]"),
        (["--spes_config.decayed_factor_update_steps=0"], "spes_config.decayed_factor_update_steps", ">= 1"),
        (["--max_duration=3ep"], "max_duration", "steps ('1000st') or tokens"),
        (["--max_duration=100steps"], "max_duration", "steps ('1000st') or tokens"),
        (["--max_duration=-5st"], "max_duration", "steps ('1000st') or tokens"),
        (["--max_duration=2e9t"], "max_duration", "steps ('1000st') or tokens"),
        (["--data.instance_filter.repetition_max_count=1"], "data.instance_filter.repetition_max_count", ">= 2"),
        (["--data.instance_filter.repetition_min_period=0"], "data.instance_filter.repetition_min_period", ">= 1"),
    ],
)
def test_inconsistent_settings_are_caught(overrides: list[str], key: str, hint: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "tiny.yaml", overrides)
    message = str(err.value)
    assert message.startswith("command line (--") and f"'{key}'" in message and hint in message


def test_ownership_is_not_checked_when_every_expert_trains() -> None:
    for mode in (["--using_dilico=true"], ["--using_spes=false"]):
        cfg, _ = load_config(CONFIGS / "tiny.yaml", [*mode, "--spes_config.num_train_experts_per_node=16"])
        assert cfg.owned_experts() is None and cfg.experts_per_block == 8


def test_inert_keys_are_reported(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        compile: null
        model:
          flash_attention: true
          init_device: meta
        wandb:
          project: spes
        data:
          instance_filter:
            repetition_max_period: 13
    """,
    )
    _, inert = load_config(path)
    assert inert == ["model.flash_attention", "model.init_device"]


# ---------------------------------------------------------------------------------------------------------------
# A config file of the first implementation, with every key it knows (data paths and tokenizer aside)

FIRST_IMPLEMENTATION = """
run_name: spes_moe_1b_4nodes
seed: 6198
dry_run: false
no_pre_train_checkpoint: true
wandb:
  name: ${run_name}
  project: spes
  group: null
  log_interval: 10
  tags: [spes]
model:
  d_model: 768
  n_heads: 12
  n_kv_heads: null
  n_layers: 12
  mlp_hidden_size: 4096
  mlp_ratio: 4
  weight_tying: false
  alibi: false
  rope: true
  rope_theta: 500000
  flash_attention: true
  attention_dropout: 0.0
  attention_layer_norm: true
  attention_layer_norm_with_affine: true
  attention_layer_norm_over_head: false
  include_bias: false
  block_type: moe
  layer_norm_type: rms
  layer_norm_eps: 1e-6
  layer_norm_with_affine: true
  bias_for_layer_norm: false
  activation_type: swiglu
  residual_dropout: 0.0
  embedding_dropout: 0.0
  max_sequence_length: 2048
  vocab_size: 151665
  embedding_size: 151665
  eos_token_id: 151643
  pad_token_id: 151643
  init_device: meta
  init_fn: normal
  init_std: 0.02
  init_cutoff_factor: 3
  using_custom_moe_impl: true
  moe_log_expert_assignment: false
  moe_top_k: 2
  moe_num_experts: 16
  moe_dropless: true
  moe_mlp_impl: sparse
  moe_zloss_weight: 0.001
  moe_loss_weight: 0.01
  moe_normalize_expert_weights: 1.0
  clip_qkv: null
  moe_shared_expert: false
compile: null
softmax_auxiliary_loss: true
auxiliary_loss_multiplier: 1e-5
fused_loss: true
using_spes: true
using_dilico: false
spes_config:
  num_peers: 4
  peer_id: 1
  num_train_experts_per_node: 4
  sync_steps: 100
  server_addr: 127.0.0.1:50051
  using_decayed_aux_loss: true
  decayed_factor_update_steps: 100
  quant_non_local_trainable_experts: false
optimizer:
  name: adamw
  learning_rate: 5.0e-4
  eps: 1.0e-8
  weight_decay: 0.1
  decay_norm_and_bias: true
  decay_embeddings: true
  betas:
  - 0.9
  - 0.95
  metrics_log_interval: 5
scheduler:
  name: cosine_with_warmup
  units: steps
  t_warmup: 2000
  t_max: 50000
  alpha_f: 0.1
  warmup_min_lr: null
tokenizer:
  identifier: Qwen/Qwen2.5-0.5B
  truncate_direction: right
save_folder: output/${run_name}/node${spes_config.peer_id}
save_overwrite: false
save_interval: 10000
save_interval_ephemeral: null
save_num_checkpoints_to_keep: 1
sharded_checkpointer: torch_new
save_interval_unsharded: 5000
save_num_unsharded_checkpoints_to_keep: 5
load_path: null
reset_optimizer_state: false
reset_trainer_state: false
restore_dataloader: true
time_limit: null
max_duration: 50000
stop_at: 50000
global_train_batch_size: 1024
device_train_microbatch_size: 8
device_eval_batch_size: 4
precision: amp_bf16
distributed_strategy: fsdp
fsdp:
  wrapping_strategy: by_block
  precision: mixed
  sharding_strategy: FULL_SHARD
ddp:
  grad_sync_mode: batch
  find_unused_params: false
activation_checkpointing: fine_grained
max_grad_norm: 1.0
max_grad_norm_ratio: null
speed_monitor:
  window_size: 1
eval_interval: 2500
eval_subset_num_batches: -1
evaluators:
  - label: piqa
    type: downstream
  - label: arc_easy
    type: downstream
data:
  pad_direction: right
  seed: 7198
  num_workers: 4
  drop_last: true
  pin_memory: true
  prefetch_factor: 8
  persistent_workers: true
  memmap_dtype: uint32
  timeout: 0
  instance_filter:
    repetition_max_period: 13
    repetition_min_period: 1
    repetition_max_count: 32
  paths:
    - data/SlimPajama-627B/030_000012.npy
    - data/SlimPajama-627B/013_000007.npy
"""


def test_first_implementation_config_loads_unchanged(tmp_path: Path) -> None:
    cfg, inert = load_config(write(tmp_path, FIRST_IMPLEMENTATION))
    assert inert == sorted(INERT_KEYS)
    assert cfg.save_folder == "output/spes_moe_1b_4nodes/node1" and cfg.wandb is not None
    assert cfg.wandb.name == "spes_moe_1b_4nodes"
    m = cfg.model
    assert (m.d_model, m.n_kv_heads, m.expert_hidden_size, m.layer_norm_eps, m.init_cutoff_factor) == (
        768,
        12,
        2048,
        1e-6,
        3.0,
    )
    assert m.normalize_expert_weights_p == 1.0 and cfg.auxiliary_loss_multiplier == 1e-5
    assert cfg.max_duration == 50000 and cfg.stop_at == 50000 and cfg.activation_checkpointing == "fine_grained"
    assert cfg.owned_experts() == (4, 8) and cfg.spes_config.using_decayed_aux_loss
    assert [e["label"] for e in cfg.evaluators] == ["piqa", "arc_easy"]
    assert cfg.data.instance_filter == InstanceFilterConfig(
        repetition_max_period=13, repetition_min_period=1, repetition_max_count=32
    )
    assert cfg.ddp.find_unused_params is False and cfg.fsdp.sharding_strategy == "FULL_SHARD"


def test_first_implementation_key_set_is_complete() -> None:
    """The inline file above lists every key the first implementation knew, each section complete."""
    raw = yaml.safe_load(FIRST_IMPLEMENTATION)
    sections = {
        "model",
        "optimizer",
        "scheduler",
        "tokenizer",
        "wandb",
        "speed_monitor",
        "data",
        "fsdp",
        "ddp",
        "spes_config",
        "evaluators",
    }
    scalar_keys = {
        "run_name",
        "seed",
        "dry_run",
        "no_pre_train_checkpoint",
        "compile",
        "fused_loss",
        "softmax_auxiliary_loss",
        "auxiliary_loss_multiplier",
        "using_spes",
        "using_dilico",
        "load_path",
        "max_duration",
        "stop_at",
        "global_train_batch_size",
        "device_train_microbatch_size",
        "device_eval_batch_size",
        "precision",
        "distributed_strategy",
        "activation_checkpointing",
        "max_grad_norm",
        "max_grad_norm_ratio",
        "eval_interval",
        "eval_subset_num_batches",
        "save_folder",
        "save_overwrite",
        "save_interval",
        "save_interval_ephemeral",
        "save_num_checkpoints_to_keep",
        "sharded_checkpointer",
        "save_interval_unsharded",
        "save_num_unsharded_checkpoints_to_keep",
        "reset_optimizer_state",
        "reset_trainer_state",
        "restore_dataloader",
        "time_limit",
    }
    assert set(raw) == scalar_keys | sections
    # keys spes added beyond the first implementation's
    added = {
        "moe_backend",
        "validation_paths",
        "url_reads",
        "entity",
        "codec",
        "codec_settings",
        "run_id",
        "token_file",
        "tls_ca",
        "tls_cert",
        "tls_key",
        "rpc_timeout_s",
        "round_timeout_s",
        "max_retries",
        "eval_after_sync",
        "data_plane",
        "overlap_sync",
        "overlap_steps",
        "overlap_correction",
        "overlap_fragments",
    }
    hints = typing.get_type_hints(TrainConfig)
    for section in sections - {"evaluators"}:
        cls = next(t for t in (hints[section], *typing.get_args(hints[section])) if dataclasses.is_dataclass(t))
        assert set(raw[section]) == {f.name for f in dataclasses.fields(cls)} - added, section


def test_every_key_has_a_doc() -> None:
    lines = config_help(TrainConfig)
    assert any(line.strip().startswith("--spes_config.peer_id=") for line in lines)
    for line in lines:
        assert not line.rstrip().endswith("]"), f"key without a doc: {line}"


def test_peers_past_the_last_expert_block_own_nothing() -> None:
    """The reference rule [p*k, min((p+1)*k, E)) allows P*k > E (the upcycled 9B run: 8 experts, 8 peers x 2)."""
    overrides = ["--spes_config.num_peers=8", "--spes_config.num_train_experts_per_node=2"]
    assert load_config(CONFIGS / "tiny.yaml", [*overrides, "--spes_config.peer_id=3"])[0].owned_experts() == (6, 8)
    cfg, _ = load_config(CONFIGS / "tiny.yaml", [*overrides, "--spes_config.peer_id=5"])
    assert cfg.owned_experts() == (8, 8)


def test_a_yaml_syntax_error_is_one_line_with_its_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "model:\n  d_model: 64\n n_heads: [4\n"))
    assert str(err.value).endswith(
        "run.yaml: line 3, column 2: not valid YAML (did not find expected key); check the indentation, colons and "
        "brackets there"
    )
    without_a_mark = yaml.YAMLError("a problem\n  on two lines")  # folded to one line, no position to name
    assert _yaml_problem(without_a_mark) == (
        "not valid YAML (a problem on two lines); check the indentation, colons and brackets there"
    )


@pytest.mark.parametrize(
    "value, parsed",
    [
        (700, (700, "steps")),
        ("1000st", (1000, "steps")),
        ("1000", (1000, "steps")),
        (" 2e9T ", (2_000_000_000, "tokens")),
    ],
)
def test_a_duration_is_steps_or_tokens(value: str | int, parsed: tuple[int, str]) -> None:
    assert parse_duration(value) == parsed


@pytest.mark.parametrize(
    "value, problem",
    [
        *((v, "must be steps ('1000st') or tokens ('2e9T')") for v in ["3ep", "ten", "5min", "1e999T", "100steps"]),
        *((v, "must be steps ('1000st') or tokens ('2e9T')") for v in ["-5st", "10ep", "2e9t", "1.2.3st"]),
        *((v, "must be a whole number of steps or tokens ('1000st', '2e9T')") for v in ["10.5st", "2.5T", "0.5"]),
    ],
)
def test_a_duration_of_epochs_another_unit_or_a_fraction_is_refused_naming_its_key(value: str, problem: str) -> None:
    """The key lets a refusal name the override that set it (`command line (--max_duration=...)`), not the file."""
    with pytest.raises(ConfigError) as err:
        parse_duration(value)
    assert str(err.value) == f"config key 'max_duration' = {value!r} {problem}"
    assert err.value.key == "max_duration"


def test_help_gives_each_key_its_default_type_and_doc_and_each_section_a_heading() -> None:
    lines = config_help(TrainConfig)
    assert "  --server.merge_topk=4  [int >= 1]  most similar other experts each expert is pulled towards" in lines
    assert "  --model.attention_dropout=0.0  [float in [0, 1)]  dropout on attention probabilities" in lines
    assert "  --run_name='spes'  [str]  name of the run" in lines
    codec_settings = next(line for line in lines if line.startswith("  --spes_config.codec_settings="))
    assert codec_settings.startswith("  --spes_config.codec_settings={}  [")  # a dict default, made by its factory
    heading = next(line for line in lines if line.startswith("  server.*"))
    assert heading.startswith("  server.*  -- ") and len(heading) > len("  server.*  -- ")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("--model.d_model=abc", "command line (--model.d_model=abc): config key 'model.d_model' = 'abc'"),
        ("--data.paths=x.npy", "write a list: --data.paths=[x.npy]"),
        ("--skip_nonfinite_steps=-1", "'skip_nonfinite_steps' = -1 must be >= 0"),
    ],
)
def test_a_bad_override_value_blames_the_command_line(override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(CONFIGS / "tiny.yaml", [override])


def test_a_list_written_as_a_string_in_yaml_gets_the_yaml_hint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("write a list: data.paths: [x.npy]")):
        load_config(write(tmp_path, "data:\n  paths: x.npy\n"))


def test_overlap_defaults_to_a_delay_of_sync_steps_and_combines_with_every_codec() -> None:
    cfg = load_config(CONFIGS / "tiny.yaml", ["--spes_config.overlap_sync=true"])[0]
    assert cfg.spes_config.overlap_delay == cfg.spes_config.sync_steps == 10
    assert load_config(CONFIGS / "tiny.yaml", ["--spes_config.overlap_steps=0"])[0].spes_config.overlap_delay == 0
    assert any(line.strip().startswith("--spes_config.overlap_sync=False") for line in config_help(TrainConfig))
    for codec in ("int8", "sparse"):
        TrainConfig(spes_config=SpesConfig(overlap_sync=True, overlap_fragments=5, sync_steps=10, codec=codec))
    with pytest.raises(
        ConfigError, match=r"unknown config key 'spes_config.wire_dtype'; it is now 'spes_config.codec'"
    ):
        load_config(CONFIGS / "tiny.yaml", ["--spes_config.wire_dtype=int8"])


def test_fragments_sync_every_sync_steps_over_f_and_land_that_much_later_by_default() -> None:
    flags = ["--spes_config.overlap_sync=true", "--spes_config.overlap_fragments=5"]
    s = load_config(CONFIGS / "tiny.yaml", flags)[0].spes_config
    assert (s.round_interval, s.overlap_delay) == (2, 2)
    assert load_config(CONFIGS / "tiny.yaml")[0].spes_config.round_interval == 10


def test_compile_and_fused_loss_left_null_are_settled_per_device() -> None:
    cfg = load_config(CONFIGS / "tiny.yaml")[0]
    assert cfg.compile is None and cfg.fused_loss is None
    gpu, cpu = cfg.on_device("cuda"), cfg.on_device("cpu")
    assert (gpu.compile, gpu.fused_loss) == ({"dynamic": False}, True)
    assert (cpu.compile, cpu.fused_loss) == (False, False)
    chosen = load_config(CONFIGS / "tiny.yaml", ["--compile=false", "--fused_loss=false"])[0].on_device("cuda")
    assert (chosen.compile, chosen.fused_loss) == (False, False)  # a value set is kept
    assert gpu.on_device("cpu") == gpu  # settled once


# Every bound of a setting: refused one past its edge with the whole message, accepted at the edge.
BOUNDS = [
    # (a setting one past its edge, the message's tail, the setting at its edge)
    (["--global_train_batch_size=0"], "'global_train_batch_size' = 0 must be > 0", []),
    ([], "", ["--global_train_batch_size=1", "--device_train_microbatch_size=1"]),
    (["--device_train_microbatch_size=0"], "'device_train_microbatch_size' = 0 must be > 0", []),
    (["--device_eval_batch_size=0"], "'device_eval_batch_size' = 0 must be > 0", ["--device_eval_batch_size=1"]),
    (["--time_limit=0"], "'time_limit' = 0.0 must be > 0 or null", ["--time_limit=0.5"]),
    (["--skip_nonfinite_steps=-1"], "'skip_nonfinite_steps' = -1 must be >= 0", ["--skip_nonfinite_steps=0"]),
    (
        ["--gen1_gc_interval=0"],
        "'gen1_gc_interval' = 0 must be >= 1 or null",
        ["--gen1_gc_interval=1"],
    ),
    (
        ["--spes_config.num_peers=0"],
        "'spes_config.num_peers' = 0 must be >= 1",
        ["--spes_config.num_peers=1", "--spes_config.num_train_experts_per_node=8"],
    ),
    (["--spes_config.sync_steps=0"], "'spes_config.sync_steps' = 0 must be >= 1", ["--spes_config.sync_steps=1"]),
    (
        ["--spes_config.decayed_factor_update_steps=0"],
        "'spes_config.decayed_factor_update_steps' = 0 must be >= 1",
        ["--spes_config.decayed_factor_update_steps=1"],
    ),
    (
        ["--spes_config.server_addr=:5000"],
        "'spes_config.server_addr' = ':5000' must be host:port",
        ["--spes_config.server_addr=h:1"],
    ),
    (
        ["--spes_config.overlap_fragments=2"],
        "'spes_config.overlap_fragments' = 2 needs spes_config.overlap_sync=true: fragments are for rounds that "
        "overlap training",
        ["--spes_config.overlap_sync=true", "--spes_config.overlap_fragments=10"],
    ),
    (
        ["--spes_config.overlap_sync=true", "--spes_config.overlap_steps=11"],
        "'spes_config.overlap_steps' = 11 must be in [0, 10] (sync_steps / overlap_fragments): a round must land "
        "before the next one is uploaded",
        ["--spes_config.overlap_sync=true", "--spes_config.overlap_steps=10"],
    ),
    (
        ["--spes_config.overlap_correction=0"],
        "'spes_config.overlap_correction' = 0.0 must be in (0, 1]: the share of each round's correction a node "
        "applies (0 would never sync)",
        ["--spes_config.overlap_correction=1"],
    ),
    (
        ["--spes_config.num_train_experts_per_node=0"],
        "'spes_config.num_train_experts_per_node' = 0 must be >= 1",
        ["--spes_config.num_train_experts_per_node=1", "--model.moe_num_experts=4"],
    ),
    (
        ["--model.moe_num_experts=16"],
        "'model.moe_num_experts' = 16 has experts no peer owns: num_peers=4 x num_train_experts_per_node=2 covers "
        "only 8 (e.g. set num_train_experts_per_node=4)",
        ["--model.moe_num_experts=8"],
    ),
    (
        ["--server.merge_alpha_start=-0.1"],
        "'server.merge_alpha_start' = -0.1 must be >= 0",
        ["--server.merge_alpha_start=0"],
    ),
    (["--server.merge_alpha_start=inf"], "'server.merge_alpha_start' = inf must be a finite number", []),
    (["--server.merge_decay_steps=0"], "'server.merge_decay_steps' = 0 must be > 0", ["--server.merge_decay_steps=1"]),
    (["--server.merge_topk=0"], "'server.merge_topk' = 0 must be >= 1", ["--server.merge_topk=1"]),
    (["--server.outer_lr=0"], "'server.outer_lr' = 0.0 must be > 0", ["--server.outer_lr=0.001"]),
    (["--server.outer_momentum=1"], "'server.outer_momentum' = 1.0 must be in [0, 1)", ["--server.outer_momentum=0"]),
    (["--server.outer_momentum=-0.1"], "'server.outer_momentum' = -0.1 must be in [0, 1)", []),
    (["--server.round_timeout_s=0"], "'server.round_timeout_s' = 0.0 must be > 0", ["--server.round_timeout_s=0.5"]),
    (["--server.min_peers=0"], "'server.min_peers' = 0 must be >= 1 or null", ["--server.min_peers=1"]),
    (["--server.min_peers=5"], "'server.min_peers' = 5 must be <= spes_config.num_peers=4", ["--server.min_peers=4"]),
    (
        ["--scheduler.warmup_min_lr=-1"],
        "'scheduler.warmup_min_lr' = -1.0 must be >= 0 or null",
        ["--scheduler.warmup_min_lr=0"],
    ),
    (
        ["--data.instance_filter.repetition_min_period=0"],
        "'data.instance_filter.repetition_min_period' = 0 must be >= 1",
        ["--data.instance_filter.repetition_min_period=1"],
    ),
    (
        ["--data.instance_filter.repetition_max_period=0", "--data.instance_filter.repetition_min_period=1"],
        "'data.instance_filter.repetition_max_period' = 0 must be >= repetition_min_period=1",
        ["--data.instance_filter.repetition_max_period=1", "--data.instance_filter.repetition_min_period=1"],
    ),
    (
        ["--data.instance_filter.repetition_max_count=1"],
        "'data.instance_filter.repetition_max_count' = 1 must be >= 2",
        ["--data.instance_filter.repetition_max_count=2"],
    ),
    (["--model.moe_top_k=0"], "'model.moe_top_k' = 0 must be in [1, moe_num_experts=8]", ["--model.moe_top_k=1"]),
    (["--model.moe_top_k=9"], "'model.moe_top_k' = 9 must be in [1, moe_num_experts=8]", ["--model.moe_top_k=8"]),
    (["--model.d_model=66"], "'model.d_model' = 66 must be divisible by model.n_heads=4", ["--model.d_model=72"]),
    (["--model.n_kv_heads=3"], "'model.n_kv_heads' = 3 must divide model.n_heads=4", ["--model.n_kv_heads=2"]),
    (["--model.d_model=68"], "'model.d_model' = 68 head size d_model / n_heads must be even for RoPE", []),
    (
        ["--model.mlp_hidden_size=127"],
        "'model.mlp_hidden_size' = 127 must be even (each expert is mlp_hidden_size / 2 wide)",
        ["--model.mlp_hidden_size=126"],
    ),
    (
        ["--model.weight_tying=true"],
        "'model.weight_tying' = True is not supported by the OLMoE-style model of spes (remove it)",
        [],
    ),
    (
        ["--max_grad_norm_ratio=0.5"],
        "'max_grad_norm_ratio' = 0.5 is not supported (OLMo's adaptive clipping): remove it; max_grad_norm clips the "
        "global gradient norm",
        ["--max_grad_norm_ratio=null"],
    ),
    (
        ["--save_interval_ephemeral=100"],
        "'save_interval_ephemeral' = 100 is not supported (OLMo's ephemeral checkpoints): remove it; save_interval "
        "with save_num_checkpoints_to_keep bounds the checkpoints kept",
        ["--save_interval_ephemeral=null"],
    ),
    (
        ["--model.embedding_size=4095"],
        "'model.embedding_size' = 4095 must be >= model.vocab_size=4096",
        ["--model.embedding_size=4096"],
    ),
    # Ranges declared with the fields (`_f(..., ge=, gt=, lt=)`), a NaN or infinity refused for every float
    (["--model.n_heads=0"], "'model.n_heads' = 0 must be >= 1", ["--model.n_heads=1"]),
    (["--model.n_kv_heads=0"], "'model.n_kv_heads' = 0 must be >= 1 or null", ["--model.n_kv_heads=1"]),
    (["--model.d_model=0"], "'model.d_model' = 0 must be >= 1", []),
    (["--model.n_layers=0"], "'model.n_layers' = 0 must be >= 1", ["--model.n_layers=1"]),
    (["--model.mlp_hidden_size=0"], "'model.mlp_hidden_size' = 0 must be >= 2 or null", ["--model.mlp_hidden_size=2"]),
    (["--model.max_sequence_length=1"], "'model.max_sequence_length' = 1 must be >= 2", []),
    (["--model.attention_dropout=1"], "'model.attention_dropout' = 1.0 must be in [0, 1)", []),
    (["--model.residual_dropout=-0.1"], "'model.residual_dropout' = -0.1 must be in [0, 1)", []),
    (["--model.layer_norm_eps=0"], "'model.layer_norm_eps' = 0.0 must be > 0", []),
    (["--model.rope_theta=nan"], "'model.rope_theta' = nan must be a finite number", []),
    (["--model.pad_token_id=-1"], "'model.pad_token_id' = -1 must be >= 0", ["--model.pad_token_id=0"]),
    (
        ["--model.eos_token_id=4096"],
        "'model.eos_token_id' = 4096 must be a token id below model.vocab_size=4096 (the tokenizer's)",
        ["--model.eos_token_id=4095"],
    ),
    (
        ["--model.pad_token_id=4096"],
        "'model.pad_token_id' = 4096 must be a token id below model.vocab_size=4096 (the tokenizer's)",
        ["--model.pad_token_id=4095"],
    ),
    (["--optimizer.learning_rate=-1"], "'optimizer.learning_rate' = -1.0 must be >= 0", []),
    (["--optimizer.eps=0"], "'optimizer.eps' = 0.0 must be > 0", []),
    (
        ["--optimizer.betas=[0.9,1]"],
        "'optimizer.betas' = [0.9, 1.0] must be two numbers in [0, 1)",
        ["--optimizer.betas=[0,0.999]"],
    ),
    (["--max_duration=0st"], "'max_duration' = '0st' must be at least one step", ["--max_duration=1st"]),
    (["--max_duration=-5"], "'max_duration' = -5 must be at least one step", ["--max_duration=1"]),
    (["--max_duration=0T"], "'max_duration' = '0T' must be at least one step", ["--max_duration=1T"]),
    (
        ["--max_duration=10.5st"],
        "'max_duration' = '10.5st' must be a whole number of steps or tokens ('1000st', '2e9T')",
        ["--max_duration=1e1st"],
    ),
    (
        ["--max_duration=0.4T"],
        "'max_duration' = '0.4T' must be a whole number of steps or tokens ('1000st', '2e9T')",
        ["--max_duration=4.0T"],
    ),
    (["--stop_at=0"], "'stop_at' = 0 must be >= 1 or null", ["--stop_at=1"]),
    (["--optimizer.betas=[0.9]"], "'optimizer.betas' = [0.9] must be two numbers in [0, 1)", []),
    (["--max_grad_norm=0"], "'max_grad_norm' = 0.0 must be > 0 or null", ["--max_grad_norm=null"]),
    (["--seed=-1"], "'seed' = -1 must be >= 0", ["--seed=0"]),
    (["--data.seed=-1"], "'data.seed' = -1 must be >= 0 or null", ["--data.seed=0"]),
    (["--log_interval=0"], "'log_interval' = 0 must be >= 1", []),
    (["--eval_interval=0"], "'eval_interval' = 0 must be >= 1 or null", ["--eval_interval=1"]),
    (["--save_interval=0"], "'save_interval' = 0 must be >= 1 or null", ["--save_interval=null"]),
    (["--eval_subset_num_batches=0"], "'eval_subset_num_batches' = 0 must be -1 (all) or >= 1", []),
    (["--save_num_checkpoints_to_keep=0"], "'save_num_checkpoints_to_keep' = 0 must be -1 (all) or >= 1", []),
    (["--speed_monitor.window_size=0"], "'speed_monitor.window_size' = 0 must be >= 1", []),
    (["--spes_config.rpc_timeout_s=inf"], "'spes_config.rpc_timeout_s' = inf must be a finite number", []),
    (["--spes_config.max_retries=-1"], "'spes_config.max_retries' = -1 must be >= 0", ["--spes_config.max_retries=0"]),
    (["--server.outer_lr=inf"], "'server.outer_lr' = inf must be a finite number", []),
]


@pytest.mark.parametrize("past, message, edge", BOUNDS)
def test_every_bound_refuses_one_past_its_edge_in_full_and_takes_the_edge(
    past: list[str], message: str, edge: list[str]
) -> None:
    if past:
        with pytest.raises(ConfigError) as err:
            load_config(CONFIGS / "tiny.yaml", past)
        assert str(err.value) in [f"command line ({given}): config key {message}" for given in past]  # blamed
    if edge:
        load_config(CONFIGS / "tiny.yaml", edge)


# ---------------------------------------------------------------------------------------------------------------
# What the user reads, word for word


def refusal(path: Path | None, *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, list(overrides))
    return str(err.value)


def test_a_file_that_is_not_a_mapping_is_refused_saying_what_it_holds(tmp_path: Path) -> None:
    """A list or a single value where the keys go (OmegaConf failed on a list with a traceback at the merge)."""
    for text, what in (("- 1\n- 2\n", "a list"), ("5\n", "a single value"), ("true\n", "a single value")):
        path = write(tmp_path, text)
        want = f"{path}: a config file must be a YAML mapping of keys to values, not {what}"
        assert refusal(path) == refusal(path, "--seed=3") == want
    assert load_config(write(tmp_path, ""))[0] == load_config(None)[0]  # an empty file: every default
    assert refusal(write(tmp_path, "wandb: []\n")) == (
        f"{tmp_path / 'run.yaml'}: config key 'wandb' = [] has the wrong type: expected WandbConfig | None"
    )
    for value in ("5", "'abc'"):
        assert refusal(write(tmp_path, f"model: {value}\n")) == (
            f"{tmp_path / 'run.yaml'}: config key 'model' = {value} has the wrong type: expected ModelConfig"
        )


def test_a_list_where_a_mapping_goes_or_back_is_refused_naming_the_key(tmp_path: Path) -> None:
    """OmegaConf merges no list into a mapping, nor a mapping into a list: its TypeError ended in a traceback. The
    keys before the culprit are read resolved, as always."""
    path = write(tmp_path, "log_interval: 5\nsave_interval: ${log_interval}\nmodel: [1, 2]\n")
    assert (
        refusal(path)
        == refusal(path, "--model.d_model=5")
        == (f"{path}: config key 'model' = [1, 2] has the wrong type: expected ModelConfig")
    )
    below = "an override sets a key below a list of"
    path = write(tmp_path, "spes_config:\n  codec_settings: {a: [1]}\n")  # a free-form mapping takes any keys
    given = "--spes_config.codec_settings.a.b=1"
    assert refusal(path, given) == f"command line ({given}): {below} {path}; set the whole list instead"
    given = "--spes_config.codec_settings.a=[1] --spes_config.codec_settings.a.b=1"
    assert refusal(None, *given.split()) == f"command line ({given}): {below} config; set the whole list instead"
    path = write(tmp_path, "optimizer:\n  betas: {a: 1}\n")
    want = f"{path}: config key 'optimizer.betas' = {{'a': 1}} has the wrong type: expected list[float]"
    assert refusal(path) == want


def test_a_wrong_type_names_the_key_the_value_and_the_type_a_user_reads() -> None:
    def wrong(override: str, key: str, value: str, expected: str) -> str:
        return f"command line (--{override}): config key '{key}' = {value} has the wrong type: expected {expected}"

    assert refusal(None, "--model.d_model=abc") == wrong("model.d_model=abc", "model.d_model", "'abc'", "int")
    assert refusal(None, "--save_interval=abc") == wrong("save_interval=abc", "save_interval", "'abc'", "int | None")
    assert refusal(None, "--optimizer.betas=5") == wrong("optimizer.betas=5", "optimizer.betas", "5", "list[float]")
    assert refusal(None, "--model=5") == wrong("model=5", "model", "5", "ModelConfig")  # a section: a mapping
    later = refusal(None, "--save_interval=${log_interval}", "--model.d_model=abc")  # checked after one it passes
    assert later == wrong("model.d_model=abc", "model.d_model", "'abc'", "int")
    for given, key, what in (("seed.x=3", "seed", "int"), ("data.paths.0=b", "data.paths", "list[str]")):
        assert refusal(None, f"--{given}") == (
            f"command line (--{given}): config key '{key}' holds {what}, not keys: there is no "
            f"'{given.partition('=')[0]}'; set the whole value instead"
        )
    for given, what in (
        ("seed==", "could not determine a constructor for the tag 'tag:yaml.org,2002:value'"),
        ("wandb.tags=[a,b", "did not find expected ',' or ']'"),
    ):
        assert (
            refusal(None, f"--{given}") == f"command line (--{given}): the value is not valid YAML ({what}); quote it"
        )
    settings = "spes_config.codec_settings"
    assert refusal(None, f"--{settings}=5") == wrong(f"{settings}=5", settings, "5", "dict")
    strategies = "'single' | 'ddp' | 'fsdp' | None"  # an Optional[Literal[...]], read as `int | None` is
    assert refusal(None, "--distributed_strategy=5") == wrong(
        "distributed_strategy=5", "distributed_strategy", "5", strategies
    )
    assert refusal(None, "--wandb.tags=abc") == wrong("wandb.tags=abc", "wandb.tags", "'abc'", "list[str] | None") + (
        "; write a list: --wandb.tags=[abc]"
    )


def test_values_and_keys_the_parser_must_not_split_or_check_wrongly() -> None:
    assert load_config(None, ["--model.d_model=1536.0"])[0].model.d_model == 1536  # a whole float: an int
    assert isinstance(load_config(None, ["--model.d_model=1536.0"])[0].model.d_model, int)
    assert load_config(None, ["--run_name=a=b"])[0].run_name == "a=b"  # the key ends at the first '='
    assert load_config(None, ["seed=3"])[0].seed == 3  # in Python, OmegaConf's own dotlist form too
    model = load_config(None, ["--model={d_model: 36, n_heads: 6}"])[0].model  # a section as one mapping
    assert (model.d_model, model.n_heads, model.n_layers) == (36, 6, ModelConfig().n_layers)
    assert load_config(None, ["--model={d_model: 36}", "--model.n_heads=6"])[0].model == model  # checked as a whole
    settings = ["--spes_config.codec=sparse", "--spes_config.codec_settings.chunk=64"]  # below a free-form mapping
    assert load_config(None, settings)[0].spes_config.codec_settings == {"chunk": 64}
    assert load_config(None, ["--save_interval=${log_interval}"])[0].save_interval == TrainConfig().log_interval
    whole = load_config(None, ["--spes_config.codec_settings=${server}"])[0].spes_config.codec_settings
    assert whole == dataclasses.asdict(TrainConfig().server)  # a mapping interpolated whole, its defaults resolved
    cfg = load_config(None, [])[0]
    assert cfg.save_folder == "output/spes" and load_config(None, ["--run_name=x"])[0].save_folder == "output/x"
    assert refusal(None, "--save_folder=${nope}") == "config: cannot read config: Interpolation key 'nope' not found"


def test_an_unknown_key_names_its_closest_key_or_every_key_of_its_section() -> None:
    valid = ", ".join(f.name for f in dataclasses.fields(type(TrainConfig().model)))
    assert refusal(None, "--model.zzzzzzzz=1") == (
        f"command line (--model.zzzzzzzz=1): unknown config key 'model.zzzzzzzz'; valid keys here: {valid}"
    )
    with pytest.raises(ConfigError) as err:
        from_dict(TrainConfig, {"sed": 1})
    assert str(err.value) == "config: unknown config key 'sed'; did you mean 'seed'?"
    with pytest.raises(ConfigError) as err:
        from_dict(TrainConfig, [1])  # type: ignore[arg-type]
    assert str(err.value) == "config: config key '<root>' must be a mapping, got [1]"
    with pytest.raises(ConfigError) as err:
        from_dict(SpesConfig, 5, where="command line", prefix="spes_config.")  # type: ignore[arg-type]
    assert str(err.value) == "command line: config key 'spes_config' must be a mapping, got 5"


def test_refusals_of_the_checks_name_the_value_they_refuse() -> None:
    peer = ["--using_spes=true", "--spes_config.num_peers=2", "--model.moe_num_experts=4"]
    assert refusal(None, "--global_train_batch_size=7", "--device_train_microbatch_size=2") == (
        "command line (--global_train_batch_size=7): config key 'global_train_batch_size' = 7 must be divisible by "
        "device_train_microbatch_size=2"
    )
    assert refusal(None, *peer, "--spes_config.peer_id=9") == (
        "command line (--spes_config.peer_id=9): config key 'spes_config.peer_id' = 9 must be in [0, num_peers=2)"
    )
    assert refusal(None, *peer, "--spes_config.overlap_fragments=3", "--spes_config.sync_steps=10") == (
        "command line (--spes_config.overlap_fragments=3): config key 'spes_config.overlap_fragments' = 3 must be "
        ">= 1 and divide sync_steps=10: a fragment's round comes every sync_steps / F steps"
    )


def test_a_refused_value_names_where_it_was_set_the_file_or_the_override(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("spes_config:\n  sync_steps: 0\n")
    assert refusal(path) == f"{path}: config key 'spes_config.sync_steps' = 0 must be >= 1"
    path.write_text("spes_config:\n  sync_steps: 5\n")
    assert refusal(path, "--spes_config.sync_steps=9", "--spes_config.sync_steps=0") == (
        "command line (--spes_config.sync_steps=0): config key 'spes_config.sync_steps' = 0 must be >= 1"
    )
    assert refusal(path, "--model={d_model: 30, n_heads: 4}") == (  # a whole section set on the command line
        "command line (--model={d_model: 30, n_heads: 4}): config key 'model.d_model' = 30 must be divisible by "
        "model.n_heads=4"
    )
    assert refusal(path, "--model={d_modl: 512}") == (  # an unknown key inside it: the override, not the file
        "command line (--model={d_modl: 512}): unknown config key 'model.d_modl'; did you mean 'model.d_model'?"
    )
    path.write_text("model:\n  d_modl: 512\n")
    assert (
        refusal(path, "--model.n_heads=4")
        == f"{path}: unknown config key 'model.d_modl'; did you mean 'model.d_model'?"
    )
    path.write_text("spes_config:\n  sync_steps: 5\n")
    d_model = ModelConfig().d_model
    assert refusal(path, "--model.n_heads=5") == (  # a check of two keys names the override of the other one
        f"command line (--model.n_heads=5): config key 'model.d_model' = {d_model} must be divisible by model.n_heads=5"
    )
    assert refusal(path, "--model.n_heads=5", "--seed=3") == refusal(path, "--model.n_heads=5")  # not the last one
    path.write_text("model:\n  n_heads: 5\n")
    assert refusal(path, "--seed=3") == (  # set in the file alone: the file
        f"{path}: config key 'model.d_model' = {d_model} must be divisible by model.n_heads=5"
    )
    path.write_text("using_spes: true\nspes_config:\n  peer_id: 1\n")
    assert refusal(path, "--model.moe_num_experts=4", "--spes_config.num_peers=1") == (
        "command line (--spes_config.num_peers=1): config key 'spes_config.peer_id' = 1 must be in [0, num_peers=1)"
    )
    both = ["--spes_config.peer_id=1", "--spes_config.num_peers=1"]  # the refused key's own override first
    assert refusal(path, *both).startswith("command line (--spes_config.peer_id=1): ")
    with pytest.raises(ConfigError) as err:  # what was refused, for a caller that names its own source
        load_config(path, ["--model.moe_num_experts=4", "--spes_config.num_peers=1"])
    assert (err.value.key, err.value.related) == ("spes_config.peer_id", ("spes_config.num_peers",))
    assert refusal(path, "--spes_config.server_addr=a=b").startswith(  # a value holding '=' names its key still
        "command line (--spes_config.server_addr=a=b): config key 'spes_config.server_addr' = 'a=b' must be host:port"
    )
    with pytest.raises(ConfigError) as err:
        from_dict(TrainConfig, {"spes_config": {"sync_steps": 0}}, where="x")
    assert err.value.key == "spes_config.sync_steps"


SPES_FILE = "using_spes: true\n"


@pytest.mark.parametrize(
    ("text", "overrides", "refused"),
    [
        ("", ["--model.n_heads=5"], "model.d_model"),
        ("model:\n  n_kv_heads: 4\n", ["--model.n_heads=6"], "model.n_kv_heads"),
        ("", ["--model.n_heads=256"], "model.d_model"),  # a head of 3: odd, for RoPE
        ("model:\n  embedding_size: 50304\n", ["--model.vocab_size=60000"], "model.embedding_size"),
        ("model:\n  moe_top_k: 2\n", ["--model.moe_num_experts=1"], "model.moe_top_k"),
        ("", ["--model.vocab_size=1"], "model.pad_token_id"),
        ("model:\n  eos_token_id: 1\n", ["--model.vocab_size=1"], "model.eos_token_id"),
        (
            "data:\n  instance_filter:\n    repetition_max_period: 5\n",
            ["--data.instance_filter.repetition_min_period=6"],
            "data.instance_filter.repetition_max_period",
        ),
        ("global_train_batch_size: 512\n", ["--device_train_microbatch_size=3"], "global_train_batch_size"),
        (SPES_FILE + "spes_config:\n  peer_id: 3\n", ["--spes_config.num_peers=2"], "spes_config.peer_id"),
        (
            SPES_FILE + "spes_config:\n  overlap_sync: true\n  overlap_fragments: 4\n",
            ["--spes_config.sync_steps=10"],
            "spes_config.overlap_fragments",
        ),
        (
            SPES_FILE + "spes_config:\n  overlap_sync: true\n  overlap_fragments: 2\n",
            ["--spes_config.overlap_sync=false"],
            "spes_config.overlap_fragments",
        ),
        (
            SPES_FILE + "spes_config:\n  overlap_sync: true\n  overlap_steps: 40\n",
            ["--spes_config.sync_steps=20"],
            "spes_config.overlap_steps",
        ),
        (
            SPES_FILE + "spes_config:\n  overlap_sync: true\n  overlap_steps: 40\n",
            ["--spes_config.overlap_fragments=4"],
            "spes_config.overlap_steps",
        ),
        (SPES_FILE + "server:\n  min_peers: 4\n", ["--spes_config.num_peers=3"], "server.min_peers"),
        (SPES_FILE, ["--spes_config.num_peers=3"], "model.moe_num_experts"),
        (SPES_FILE, ["--spes_config.num_train_experts_per_node=1"], "model.moe_num_experts"),
        (
            "using_dilico: true\n" + SPES_FILE + "server:\n  outer_optimizer: nesterov\n",
            ["--using_dilico=false"],
            "server.outer_optimizer",
        ),
        ("server:\n  outer_optimizer: nesterov\n", ["--using_spes=true"], "server.outer_optimizer"),
    ],
)
def test_a_check_between_keys_names_the_override_of_the_key_it_was_not_refusing(
    tmp_path: Path, text: str, overrides: list[str], refused: str
) -> None:
    """Every check that reads a second key: the refused key is set by the file (or its default), the other by an
    override, and the refusal names that override (the file holds nothing wrong on its own)."""
    path = write(tmp_path, text)
    load_config(path)
    assert refusal(path, "--seed=3", *overrides).startswith(
        f"command line ({overrides[-1]}): config key '{refused}' = "
    )


def test_a_server_without_yaml_takes_defaults_for_the_sections_its_command_line_leaves_out() -> None:
    spes, server, mode = load_sync_sections(["--server.merge_interval=5"])
    assert spes == SpesConfig() and server.merge_interval == 5 and mode == "spes"
    spes, server, mode = load_sync_sections(["--spes_config.num_peers=3"])
    assert spes.num_peers == 3 and server == type(server)() and mode == "spes"
    with pytest.raises(ConfigError) as err:
        load_sync_sections(["--server.merge_topk=0"])
    assert str(err.value) == "command line: config key 'server.merge_topk' = 0 must be >= 1"
    with pytest.raises(ConfigError) as err:  # a sync key whose value holds '=': its type is wrong, not its key
        load_sync_sections(["--using_spes=a=b"])
    assert str(err.value).endswith("config key 'using_spes' = 'a=b' has the wrong type: expected bool")


def test_help_lists_every_section_and_key_with_its_doc() -> None:
    lines = config_help(TrainConfig)
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    model = {f.name: f for f in dataclasses.fields(type(TrainConfig().model))}
    assert f"  model.*  -- {fields['model'].metadata['doc']}" in lines
    d_model = model["d_model"]
    assert f"  --model.d_model={d_model.default!r}  [int >= 1]  {d_model.metadata['doc']}" in lines
    save = fields["save_interval"]
    assert f"  --save_interval={save.default!r}  [int >= 1 | None]  {save.metadata['doc']}" in lines
    # one style for every type however it is written (Optional[...], Union[...], X | None), a range on its number
    kinds = [line.split("  [", 1)[1].split("]  ", 1)[0] for line in lines if line.startswith("  --")]
    assert "'single' | 'ddp' | 'fsdp' | None" in kinds and "float > 0 | bool | None" in kinds
    assert "'whole_layer' | 'fine_grained' | 'one_in_two' | 'one_in_four' | bool | None" in kinds
    assert not [k for k in kinds if any(typing in k for typing in ("Optional", "Union", "Literal", "NoneType"))]


def test_a_resume_notes_a_load_path_it_passes_over_and_only_that() -> None:
    """A resume reads save_folder; the YAML's load_path (other weights, read only by a fresh start) is named, one
    naming save_folder itself (however spelt) is not, nor is no load_path."""
    cfg = TrainConfig(save_folder="out/run")
    assert passed_over(cfg) is None
    cfg.load_path = "out/./run/"
    assert passed_over(cfg) is None
    cfg.load_path = "init/step0"
    assert passed_over(cfg) == "note: resuming save_folder out/run; load_path init/step0 is not read"


def test_changed_settings_name_each_key_a_resume_changes_but_not_how_it_was_launched() -> None:
    saved = to_dict(TrainConfig())
    launched = SpesConfig(server_addr="127.0.0.1:35993", run_id="87dad67f")  # what spes.launch sets at each resume
    now = to_dict(
        TrainConfig(
            load_path="out", dry_run=True, max_duration="2000st", model=ModelConfig(n_layers=3), spes_config=launched
        )
    )
    assert changed_settings(saved, now) == ["max_duration: '1000st' -> '2000st'", "model.n_layers: 12 -> 3"]
    del saved["model"]["n_layers"], saved["max_duration"]  # a key an earlier spes did not save is no change
    assert changed_settings(saved, now) == []
    now["tensorboard"] = {"log_dir": "tb"}  # a section that was null: one change, not a walk into null
    assert changed_settings({**saved, "tensorboard": None}, now) == ["tensorboard: None -> {'log_dir': 'tb'}"]


def test_a_refusal_of_one_key_carries_the_key() -> None:
    """What lets a caller that filled the key from elsewhere (the HF import) name its own source too."""
    for build, key in [
        (lambda: ModelConfig(n_heads=0), "model.n_heads"),
        (lambda: ModelConfig(d_model=30, n_heads=4), "model.d_model"),
    ]:
        with pytest.raises(ConfigError) as err:
            build()
        assert err.value.key == key and f"config key '{key}'" in str(err.value)
