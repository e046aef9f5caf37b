"""Every benchmark figure that compares runs refuses runs measured under different premises (tokens, model shape,
link, bytes moved): a ratio of unlike runs is no result. Each case takes committed records, changes one premise and
expects the figure (or the benchmark) to refuse, naming it."""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO / "bench"))

from figures import FIGURES  # noqa: E402
from records import Records  # noqa: E402


def changed(tmp_path: Path, figure: str, records: list[str], edit: dict[str, object]) -> Records:
    """A results directory holding `records` as committed, the last with `edit` applied (key paths joined by '/'),
    after checking that `figure` renders from the unchanged copies."""
    for name in records:
        shutil.copy(RESULTS / f"{name}.json", tmp_path / f"{name}.json")
    FIGURES[figure](Records(tmp_path))
    path = tmp_path / f"{records[-1]}.json"
    record = json.loads(path.read_text())
    for key_path, value in edit.items():
        *parents, last = key_path.split("/")
        node = record
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value
    path.write_text(json.dumps(record))
    return Records(tmp_path)


@pytest.mark.parametrize(
    ("figure", "records", "edit", "named"),
    [
        (
            "fused.in_forward_ab",
            ["bench_fused_loss_1680c42", "bench_fused_loss"],
            {"overrides": ["--model.n_layers=4"]},
            "overrides",
        ),
        (
            "fused.own_backward_ab",
            ["bench_fused_loss_c05659f", "bench_fused_loss_1680c42"],
            {"arms/fused/tokens_per_step": 1024},
            "tokens_per_step",
        ),
        (
            "wan.pipelining_ab",
            [f"wan_ab_{w}_{n}" for w in ("sparse", "int8") for n in range(1, 5)],
            {"measurements/0/scale": 48},
            "scale",
        ),
        (
            "wan.sparse_defer_ab",
            [f"wan_sparse_defer_{n}" for n in ("a1", "b1", "b2", "a2")],
            {"measurements/1/rtt_ms": 100.0},
            "rtt_ms",
        ),
        (
            "wan.sparse_cpu_ab",
            [f"wan_sparse_cpu_{n}" for n in ("a1", "b1", "b2", "a2")],
            {"measurements/2/plane": "grpc"},
            "plane",
        ),
        (
            "overlap.f5_ratio",
            ["bench_overlap_f5", "bench_overlap_f5_pair2"],
            {"overrides": ["--model.n_layers=2"]},
            "overrides",
        ),
        ("overlap.f5_ratio", ["bench_overlap_f5", "bench_overlap_f5_pair2"], {"fragments": 2}, "fragments"),
        ("wan.gpu_grouped_speedup", ["bench_wan_gpu", "bench_wan_gpu_steps"], {"runs/0/microbatch": 4}, "microbatch"),
        ("wan.gpu_grouped_speedup", ["bench_wan_gpu", "bench_wan_gpu_steps"], {"device": "NVIDIA H100"}, "device"),
        (
            "codec.own_blocks",
            ["mini_repro_codecs", "mini_repro_codecs_f5_held", "mini_repro_codecs_own"],
            {"setup/steps": 200},
            "setup",
        ),
        (
            "codec.own_blocks",
            ["mini_repro_codecs", "mini_repro_codecs_f5_held", "mini_repro_codecs_own"],
            {"arms/codec_sparse/flags": ["--spes_config.codec=sparse:topk=256"]},
            "flags",
        ),
    ],
)
def test_a_figure_comparing_runs_refuses_runs_of_other_premises(
    tmp_path: Path, figure: str, records: list[str], edit: dict[str, object], named: str
) -> None:
    with pytest.raises(ValueError, match=f"differ in {named}"):
        FIGURES[figure](changed(tmp_path, figure, records, edit))


def test_bench_sync_refuses_a_ratio_of_rounds_that_moved_other_bytes() -> None:
    """SPES's round against the raw socket's is a throughput ratio only at equal bytes per peer, up and down."""
    from bench_sync import comparison

    record = json.loads((RESULTS / "bench_sync.json").read_text())["measurements"]["fp32_tcp"]
    spes, raw = record["spes_rounds"], record["raw_rounds"]
    assert comparison(spes, raw, [0.1], {})["spes_over_raw_throughput"] > 0
    first = copy.deepcopy(spes)
    first[0]["down_per_peer"][1] *= 2  # a held-model codec's first round: full values down
    with pytest.raises(SystemExit, match="moved different bytes per peer"):
        comparison(first, raw, [0.1], {})
