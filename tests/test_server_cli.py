"""The parameter server's command line (`spes.sync.server.build_parser`, `config_from_args`, `main`): the run's
settings come from its YAML and `--section.key=value` overrides, the flags are the deployment's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spes.config import ServerSection
from spes.sync.server import ServerConfig, build_parser, config_from_args, merge_of, outer_of

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def server_config(*argv: str) -> ServerConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


@pytest.mark.parametrize(
    ("config", "layout"),
    [
        ("tiny.yaml", (4, 2, "spes")),
        ("spes_1b/node_2.yaml", (4, 4, "spes")),
        (
            "diloco_1b/node_0.yaml",
            (4, 16, "diloco"),
        ),  # a DiLoCo node stores (and announces) all 16 experts as one block
        ("upcycled_9b/node_7.yaml", (8, 2, "spes")),
    ],
)
def test_the_runs_yaml_gives_the_server_its_layout(config: str, layout: tuple[int, int, str]) -> None:
    cfg = server_config(str(CONFIGS / config))
    assert (cfg.num_peers, cfg.experts_per_peer, cfg.mode) == layout
    assert cfg.expected_manifest is not None


def test_the_server_section_and_overrides_reach_the_round_maths(tmp_path: Path) -> None:
    run = tmp_path / "run.yaml"
    run.write_text(
        "using_spes: true\nserver:\n  merge_interval: 50\n  dead_peer_policy: quorum\n  min_peers: 3\n"
        "spes_config:\n  num_peers: 4\n"
    )
    cfg = server_config(str(run), "--server.merge_alpha_start=0.05", "--server.round_timeout_s=30", "--port", "0")
    assert (cfg.merge.interval, cfg.merge.alpha_start, cfg.merge.decay_steps) == (50, 0.05, 10000)
    assert (cfg.round_timeout_s, cfg.dead_peer_policy, cfg.min_peers, cfg.port) == (30.0, "quorum", 3, 0)
    # overrides of any section apply to the server's copy of the run, as to the nodes'
    diloco = server_config(str(run), "--using_dilico=true", "--server.outer_optimizer=nesterov")
    assert (diloco.mode, diloco.experts_per_peer, diloco.outer.optimizer) == ("diloco", 8, "nesterov")


def test_the_former_run_flags_spell_server_overrides() -> None:
    tiny = str(CONFIGS / "tiny.yaml")
    assert server_config(tiny, "--merge_interval", "0", "--merge_topk", "2").merge == merge_of(
        ServerSection(merge_interval=0, merge_topk=2)
    )
    legacy = server_config(
        "--total_peers",
        "2",
        "--num_train_experts_per_node",
        "2",
        "--mode",
        "diloco",
        "--outer_optimizer",
        "nesterov",
        "--outer_lr",
        "0.5",
        "--round_timeout",
        "9",
    )
    assert (legacy.num_peers, legacy.experts_per_peer, legacy.mode) == (2, 2, "diloco")
    assert legacy.expected_manifest is None
    assert legacy.outer == outer_of(ServerSection(outer_optimizer="nesterov", outer_lr=0.5))
    assert legacy.round_timeout_s == 9.0


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["configs/centralized_1b.yaml"], "is a centralized run (using_spes: false), which has no parameter server"),
        (["configs/tiny.yaml", "--server.merge_intervall=3"], "did you mean 'server.merge_interval'?"),
        (["configs/tiny.yaml", "--server.merge_topk=0"], "config key 'server.merge_topk' = 0 must be >= 1"),
        (
            ["configs/tiny.yaml", "--num_train_experts_per_node", "4"],
            "--num_train_experts_per_node=4 disagrees with configs/tiny.yaml, whose run has 2",
        ),
        (
            ["--total_peers", "2", "--num_train_experts_per_node", "2", "--spes_config.num_peers=2"],
            "without the run's YAML only --server.key=value overrides apply",
        ),
        ([], "no run given: pass the run's YAML"),
    ],
)
def test_mistakes_name_the_key_or_flag(argv: list[str], expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        server_config(*argv)


def test_main_reports_a_bad_run_in_one_line_and_help_lists_the_section() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "spes.server", "configs/tiny.yaml", "--server.merge_intervall=3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "error: command line (--server.merge_intervall=3): unknown config key 'server.merge_intervall'; did you mean "
        "'server.merge_interval'?"
    ]
    help_text = subprocess.run(
        [sys.executable, "-m", "spes.server", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for key in ("--server.merge_interval=500", "--server.outer_optimizer='none'", "--server.dead_peer_policy='wait'"):
        assert key in help_text
