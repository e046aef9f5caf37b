"""Named figures that `bench/report.py` writes into sentences of README.md and docs/ (`<!--f:NAME-->...<!--/f-->`).

Each is a function of the records (`records.Records`) returning the figure as the text shows it, unit included.
A figure that is a plain value of one record needs no name here: the document writes its path instead
(`record/key/...|unit:format`). What is here derives something (a ratio, a range over seeds, a gap over steps).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from statistics import median
from typing import Any

from records import (
    BEFORE_CARRIED_FIX,
    CODEC_SEEDS,
    CUDA_DEFAULTS,
    DENSE_SPARSE,
    DILOCO_CURVE,
    F5_RECORDS,
    INT8_RECORD,
    OWN_BLOCKS,
    Missing,
    Records,
    codec_losses,
    default_gpu_step,
    f5_arms,
    gpu_variant,
    int8_runs,
    link,
    wire_measured,
)

Figure = Callable[[Records], str]
FIGURES: dict[str, Figure] = {}
MIB, GIB = 2**20, 2**30


def fig(name: str) -> Callable[[Figure], Figure]:
    """Register a named figure."""

    def register(fn: Figure) -> Figure:
        FIGURES[name] = fn
        return fn

    return register


def span(values: Iterable[float], spec: str, unit: str = "") -> str:
    """`lo-hi` (or one value when they print alike) of `values` in format `spec`, then `unit`."""
    values = sorted(values)
    lo, hi = format(values[0], spec), format(values[-1], spec)
    if lo == hi:
        return f"{lo}{unit}"
    if spec.startswith("+"):
        return f"{lo}{unit} to {hi}{unit}"
    return f"{lo.removesuffix('%') if hi.endswith('%') else lo}-{hi}{unit}"


def rel(a: float, b: float) -> float:
    """a relative to b: (a - b) / b."""
    return (a - b) / b


def premises(what: str, runs: dict[str, dict[str, Any]]) -> None:
    """Refuse a figure that compares runs (by name: the premises each was measured under) unless every run has the
    same premises: ValueError naming the first that differs and each run's value of it."""
    first = next(iter(runs.values()))
    for key in first:
        values = {name: run.get(key) for name, run in runs.items()}
        if any(v != first[key] for v in values.values()):
            raise ValueError(f"{what}: the runs compared differ in {key}: {values}")


# ---------------------------------------------------------------------------------------------------------------
# 1. Memory (bench_memory)


@fig("memory.analytic_agreement")
def _memory_agreement(r: Records) -> str:
    return f"{max(abs(c['rel_err']) for c in r('bench_memory')['checks']):.2%}"


@fig("memory.peak_saving")
def _memory_peak_saving(r: Records) -> str:
    m = r("bench_memory")["measured"]
    spes, full = (m[k]["measured"]["peak_minus_before_bytes"] for k in ("spes", "full"))
    return f"{(spes - full) / MIB:,.0f} MiB, {(full - spes) / full:.0%}"


@fig("memory.static_saving")
def _memory_static_saving(r: Records) -> str:
    m = r("bench_memory")["measured"]
    spes, full = (m[k]["measured"]["static_bytes"] for k in ("spes", "full"))
    return f"{(spes - full) / MIB:,.0f} MiB"


@fig("memory.1b_ratio")
def _memory_1b_ratio(r: Records) -> str:
    p = r("bench_memory")["paper_1b"]
    spes, full = (p[k]["analytic"]["static_bytes"] for k in ("spes", "full"))
    return f"{spes / full:.3f}x"


@fig("memory.1b_static")
def _memory_1b_static(r: Records) -> str:
    p = r("bench_memory")["paper_1b"]
    spes, full = (p[k]["analytic"]["static_bytes"] / GIB for k in ("spes", "full"))
    return f"{spes:.2f} vs {full:.2f} GiB"


# ---------------------------------------------------------------------------------------------------------------
# 2. Bytes on the wire (bench_wire)


def _schemes(r: Records, which: str = "paper_1b") -> dict[str, Any]:
    return r("bench_wire")[which]["schemes"]


@fig("wire.small_spes_vs_diloco")
def _wire_small(r: Records) -> str:
    s = _schemes(r, "measured_config")
    spes, dil = s["spes_fp32"]["up_plus_down"], s["diloco_fp32"]["up_plus_down"]
    return f"{spes / MIB:.1f} MiB against {dil / MIB:.1f} MiB ({rel(spes, dil):+.1%})"


@fig("wire.checked_rounds")
def _wire_checked(r: Records) -> str:
    checks = r("bench_wire")["checks"]
    equal = sum(c["equal"] for c in checks)
    return f"all {len(checks)}" if equal == len(checks) else f"{equal} of {len(checks)}"


def _framing(r: Records, dtype: str, field: str) -> str:
    f = r("bench_wire")["framing"][dtype]
    return f"{(f[field] - f['payload']) / f['payload']:.3%}"


@fig("wire.framing_grpc")
def _wire_framing_grpc(r: Records) -> str:
    f = r("bench_wire")["framing"]["fp32"]
    return (
        f"{(f['serialized'] - f['payload']) / 1e3:.1f} KB to a {f['payload'] / 1e6:.0f} MB upload: "
        f"{_framing(r, 'fp32', 'serialized')} (fp32), {_framing(r, 'bf16', 'serialized')} (bf16)"
    )


@fig("wire.framing_tcp")
def _wire_framing_tcp(r: Records) -> str:
    f = r("bench_wire")["framing"]["fp32"]
    return (
        f"{(f['data_plane'] - f['payload']) / 1e3:.1f} KB: {_framing(r, 'fp32', 'data_plane')} (fp32), "
        f"{_framing(r, 'bf16', 'data_plane')} (bf16)"
    )


@fig("wire.int8_slices")
def _wire_int8_slices(r: Records) -> str:
    measured = wire_measured(r)
    slices = measured["int8"]["slices"]
    peak = max(
        max(s["peak_rss_clients"], s["peak_rss_server"]) for m in measured.values() for s in m["slices"].values()
    )
    return f"{len(slices)} slices (peak {peak / GIB:.1f} GiB per process)"


@fig("wire.int8_factors")
def _wire_int8_factors(r: Records) -> str:
    s = _schemes(r)
    ref = s["reference_fp32"]["up_plus_down"]
    spes, int8 = s["spes_fp32"]["up_plus_down"], s["spes_int8"]["up_plus_down"]
    return f"{int8 / ref:.4f} = SPES's {spes / ref:.3f} of the elements x int8's {int8 / spes:.4f} of fp32's bytes"


@fig("wire.int8_vs_bf16")
def _wire_int8_vs_bf16(r: Records) -> str:
    s = _schemes(r)
    return f"{s['spes_int8']['up_plus_down'] / s['spes_bf16']['up_plus_down']:.3f}x"


@fig("wire.1b_bf16_gb")
def _wire_1b_bf16(r: Records) -> str:
    return f"{_schemes(r)['spes_bf16']['up_plus_down'] / 1e9:.2f} GB"


# ---------------------------------------------------------------------------------------------------------------
# 2b. Codecs: final loss against fp32 (mini_repro --codecs)


@fig("int8.loss_vs_fp32")
def _int8_loss(r: Records) -> str:
    return " and ".join(f"{x['arms']['codec_int8']['vs_fp32']:+.3%}" for x in int8_runs(r))


@fig("int8.curve_gap")
def _int8_curve_gap(r: Records) -> str:
    runs = int8_runs(r)
    gaps = [
        abs(a - b)
        for x in runs
        for a, b in zip(x["curves"]["spes"]["val_loss"], x["curves"]["codec_int8"]["val_loss"], strict=True)
    ]
    return f"{max(gaps):.3f} at any of its {len(runs[0]['curves']['spes']['val_loss'])} evaluations"


@fig("int8.bytes_ratio")
def _int8_bytes_ratio(r: Records) -> str:
    c = r(INT8_RECORD)["curves"]
    return f"{c['codec_int8']['bytes'][-1] / c['spes']['bytes'][-1]:.3f}x"


# ---------------------------------------------------------------------------------------------------------------
# 3. Sync throughput (bench_sync)


def _sync(r: Records, run: str) -> dict[str, Any]:
    return r("bench_sync")["measurements"][run]


@fig("sync.round_gb")
def _sync_round_gb(r: Records) -> str:
    rnd = _sync(r, "fp32_tcp")["spes_rounds"][0]
    return (
        f"uploads {rnd['up_per_peer'][0] / 1e9:.2f} GB and downloads {rnd['down_per_peer'][0] / 1e9:.2f} GB "
        f"(fp32), so a round moves {rnd['bytes'] / 1e9:.2f} GB"
    )


@fig("sync.tcp_rounds")
def _sync_tcp_rounds(r: Records) -> str:
    m = _sync(r, "fp32_tcp")
    spes = ", ".join(f"{x['seconds']:.2f}" for x in m["spes_rounds"])
    return f"{spes} s (raw {span((x['seconds'] for x in m['raw_rounds']), '.2f', ' s')})"


@fig("sync.grpc_share")
def _sync_grpc_share(r: Records) -> str:
    return span((_sync(r, k)["spes_over_raw_throughput"] for k in ("fp32_grpc", "bf16_grpc")), ".0%")


@fig("sync.raw_gb_s")
def _sync_raw(r: Records) -> str:
    return f"{max(x['gb_s'] for x in _sync(r, 'fp32_tcp')['raw_rounds']):.1f} GB/s"


@fig("sync.exchange_at_1gbit")
def _sync_at_1gbit(r: Records) -> str:
    fp32 = sum(_sync(r, "fp32_tcp")["spes_rounds"][0][k][0] for k in ("up_per_peer", "down_per_peer"))
    bf16 = sum(_sync(r, "bf16_tcp")["spes_rounds"][0][k][0] for k in ("up_per_peer", "down_per_peer"))
    return f"({fp32 / 1e9:.2f} GB) takes {fp32 * 8 / 1e9:.1f} s on the wire and bf16 {bf16 * 8 / 1e9:.1f} s"


# ---------------------------------------------------------------------------------------------------------------
# 4. Aggregation (bench_aggregate)


def _agg(r: Records, case: str, dtype: str) -> dict[str, Any]:
    return next(x for x in r("bench_aggregate")["results"] if x["case"] == case and x["dtype"] == dtype)


@fig("aggregate.plain_vs_copy")
def _agg_plain(r: Records) -> str:
    row = _agg(r, "spes plain round", "fp32")
    return f"{1 / row['aggregate_over_copy_into']:.1f}x"


@fig("aggregate.plain_vs_clone")
def _agg_clone(r: Records) -> str:
    return f"{_agg(r, 'spes plain round', 'fp32')['aggregate_over_memcpy']:.1f}x"


@fig("aggregate.bf16_merge_s")
def _agg_bf16_merge(r: Records) -> str:
    return f"{_agg(r, 'spes merge round', 'bf16')['aggregate_s']:.2f} s"


@fig("aggregate.clone_range")
def _agg_clone_range(r: Records) -> str:
    return span((x["memcpy_gb_s"] for x in r("bench_aggregate")["results"]), ".1f", " GB/s")


# ---------------------------------------------------------------------------------------------------------------
# 5. Training speed (bench_train, bench_train_gpu, bench_fused_loss)


def _train(r: Records, variant: str, record: str = "bench_train") -> dict[str, Any]:
    return next(x for x in r(record)["results"] if x["variant"] == variant)


@fig("train.spes_speedup")
def _train_speedup(r: Records) -> str:
    return f"{_train(r, 'spes/torch')['speed_vs_full_torch']:.2f}x"


@fig("train.grouped_cpu")
def _train_grouped_cpu(r: Records) -> str:
    ratios = [
        _train(r, f"{kind}/grouped_mm")["tokens_per_s"] / _train(r, f"{kind}/torch")["tokens_per_s"]
        for kind in ("spes", "full")
    ]
    return span(ratios, ".2f", "x")


@fig("train.mflop_per_token")
def _train_mflop(r: Records) -> str:
    return f"{r('bench_train')['tflops_per_token'] * 1e6:.1f} MFLOP/token"


@fig("train.grouped_gpu")
def _train_grouped_gpu(r: Records) -> str:
    return span(
        (_train(r, f"{k}/grouped_mm", "bench_train_gpu")["speed_vs_full_torch"] for k in ("spes", "full")), ".2f", "x"
    )


@fig("train.gpu_mfu")
def _train_gpu_mfu(r: Records) -> str:
    return span((x["mfu"] for x in r("bench_train_gpu")["results"]), ".2%")


@fig("train.gpu_spes_loop")
def _train_gpu_spes_loop(r: Records) -> str:
    return f"{_train(r, 'spes/torch', 'bench_train_gpu')['speed_vs_full_torch']:.2f}x"


@fig("fused.memory_ratio")
def _fused_memory(r: Records) -> str:
    return f"{r('bench_fused_loss')['memory_ratio']:.2f}x"


def _fused_ab(r: Records, names: tuple[str, str]) -> str:
    """Two commits' `fused_loss` step, each as a ratio to the whole logits' step measured in its own run; refused
    unless both runs trained the same node on the same tokens on the same kind of machine."""
    before, after = (r(name) for name in names)
    premises(
        "fused_loss before and after",
        {
            name: {
                "mode": x["mode"],
                "device": x["device"],
                "config": x["config"],
                "overrides": x["overrides"],
                "tokens_per_step": {arm: a["tokens_per_step"] for arm, a in x["arms"].items()},
                "vocab": {arm: a["vocab"] for arm, a in x["arms"].items()},
                "cpus": x["machine"]["cpus"],
            }
            for name, x in zip(names, (before, after))
        },
    )
    return (
        f"memory {before['memory_ratio']:.2f}x -> {after['memory_ratio']:.2f}x, step time "
        f"{before['step_time_ratio']:.2f}x -> {after['step_time_ratio']:.2f}x of the whole logits' "
        f"({before['commit'][:7]} -> {after['commit'][:7]}, each ratio within its own run)"
    )


@fig("fused.own_backward_ab")
def _fused_own_backward(r: Records) -> str:
    return _fused_ab(r, ("bench_fused_loss_c05659f", "bench_fused_loss_1680c42"))


@fig("fused.in_forward_ab")
def _fused_in_forward(r: Records) -> str:
    return _fused_ab(r, ("bench_fused_loss_1680c42", "bench_fused_loss"))


@fig("fused.time_ratio")
def _fused_time(r: Records) -> str:
    return f"{r('bench_fused_loss')['step_time_ratio']:.2f}x"


@fig("gpu.gib_per_sequence")
def _gpu_per_sequence(r: Records) -> str:
    runs = {
        x["microbatch"]: x["peak_memory_gib"] for x in r("bench_wan_gpu_steps")["runs"] if x["moe_backend"] == "torch"
    }
    (a, pa), (b, pb) = sorted(runs.items())[:2]
    return f"{(pb - pa) / (b - a):.1f} GiB"


def _gpu_variant(r: Records, record: str, name: str) -> dict:
    v = gpu_variant(r(record), name)
    if v is None:
        raise Missing(f"{record}: no finished variant {name!r}")
    return v


def _gpu_ratio(r: Records, record: str, faster: str, slower: str) -> str:
    """Tokens/s of one variant over another's, both of one run (`record`): never across runs."""
    a, b = (_gpu_variant(r, record, name)["tokens_per_s"] for name in (faster, slower))
    return f"{a / b:.2f}x ({a:,.0f} / {b:,.0f} tokens/s)"


@fig("gpu.compile_speedup")
def _gpu_compile_speedup(r: Records) -> str:
    return _gpu_ratio(r, "bench_gpu_compile", "grouped_mm+compile", "grouped_mm")


@fig("gpu.head_speedup")
def _gpu_head_speedup(r: Records) -> str:
    return _gpu_ratio(r, "bench_gpu_head", CUDA_DEFAULTS, "grouped_mm+compile")


@fig("gpu.head_memory")
def _gpu_head_memory(r: Records) -> str:
    fused = _gpu_variant(r, "bench_gpu_head", CUDA_DEFAULTS)["peak_memory_bytes"]
    whole = _gpu_variant(r, "bench_gpu_head", "grouped_mm+compile")["peak_memory_bytes"]
    return f"{fused / GIB:.1f} GiB against {whole / GIB:.1f} GiB"


@fig("gpu.default_step")
def _gpu_default_step(r: Records) -> str:
    step_s, name = default_gpu_step(r)
    return f"{step_s:.2f} s (`{name}.json`)"


@fig("gpu.best_mfu")
def _gpu_best_mfu(r: Records) -> str:
    v = _gpu_variant(r, "bench_gpu_head", CUDA_DEFAULTS)
    return f"{v['mfu']:.1%} ({v['mfu_done']:.1%} of the FLOPs done)"


@fig("gpu.same_variant_spread")
def _gpu_spread(r: Records) -> str:
    a = _gpu_variant(r, "bench_gpu_compile", "grouped_mm+compile")["tokens_per_s"]
    b = _gpu_variant(r, "bench_gpu_head", "grouped_mm+compile")["tokens_per_s"]
    return f"{a:,.0f} and {b:,.0f} tokens/s"


# ---------------------------------------------------------------------------------------------------------------
# 6. Mini-reproduction (mini_repro, mini_repro_seed7)

SEEDS = ("mini_repro", "mini_repro_seed7")


def _finals(r: Records, run: str) -> list[float]:
    return [r(n)["curves"][run]["val_loss"][-1] for n in SEEDS]


def _gaps(r: Records, a: str, b: str, *, from_step: int = 0, to_step: int | None = None) -> list[float]:
    """a - b at every evaluated step in [from_step, to_step], both seeds."""
    out = []
    for name in SEEDS:
        c = r(name)["curves"]
        for step, x, y in zip(c[a]["step"], c[a]["val_loss"], c[b]["val_loss"], strict=True):
            if step >= from_step and (to_step is None or step <= to_step):
                out.append(x - y)
    return out


@fig("mini.vs_central")
def _mini_vs_central(r: Records) -> str:
    return span((rel(a, b) for a, b in zip(_finals(r, "spes"), _finals(r, "centralized"))), ".1%")


@fig("mini.diloco_vs_central")
def _mini_diloco_vs_central(r: Records) -> str:
    return span((rel(a, b) for a, b in zip(_finals(r, "diloco"), _finals(r, "centralized"))), ".1%")


@fig("mini.spes_vs_diloco")
def _mini_spes_vs_diloco(r: Records) -> str:
    return span((rel(a, b) for a, b in zip(_finals(r, "spes"), _finals(r, "diloco"))), ".1%")


@fig("mini.bytes_saving")
def _mini_bytes(r: Records) -> str:
    c = r("mini_repro")["curves"]
    return f"{-rel(c['spes']['bytes'][-1], c['diloco']['bytes'][-1]):.0%}"


@fig("mini.end_gap_diloco")
def _mini_end_gap_diloco(r: Records) -> str:
    return span((a - b for a, b in zip(_finals(r, "diloco"), _finals(r, "centralized"))), ".2f", " nats")


@fig("mini.end_gap_spes")
def _mini_end_gap_spes(r: Records) -> str:
    return span((a - b for a, b in zip(_finals(r, "spes"), _finals(r, "centralized"))), ".2f", " nats")


@fig("mini.trail_diloco_from_80")
def _mini_trail_diloco(r: Records) -> str:
    return span(_gaps(r, "diloco", "centralized", from_step=80), ".2f", " nats")


@fig("mini.trail_spes_from_80")
def _mini_trail_spes(r: Records) -> str:
    return span(_gaps(r, "spes", "centralized", from_step=80), ".2f", " nats")


@fig("mini.spes_diloco_end_nats")
def _mini_sd_end(r: Records) -> str:
    return " / ".join(f"{a - b:.2f}" for a, b in zip(_finals(r, "spes"), _finals(r, "diloco"))) + " nats"


@fig("mini.spes_diloco_first_40")
def _mini_sd_first(r: Records) -> str:
    return f"{max(abs(g) for g in _gaps(r, 'spes', 'diloco', to_step=40)):.3f} nats"


@fig("mini.spes_diloco_from_80")
def _mini_sd_80(r: Records) -> str:
    return span(_gaps(r, "spes", "diloco", from_step=80), ".2f", " nats")


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """ys at x, linear between the points (None outside them)."""
    for i in range(1, len(xs)):
        if xs[i - 1] <= x <= xs[i]:
            return ys[i - 1] + (x - xs[i - 1]) / (xs[i] - xs[i - 1]) * (ys[i] - ys[i - 1])
    return None


def _per_byte_leads(r: Records) -> list[list[tuple[float, float]]]:
    """Per seed, (SPES's bytes, DiLoCo's loss at those bytes - SPES's) at each SPES evaluation DiLoCo spans."""
    out = []
    for name in SEEDS:
        c = r(name)["curves"]
        s, d = c["spes"], c["diloco"]
        leads = [(b, _interp(b, d["bytes"], d["val_loss"])) for b in s["bytes"]]
        out.append([(b, v - loss) for (b, v), loss in zip(leads, s["val_loss"], strict=True) if v is not None])
    return out


@fig("mini.per_byte_ahead_from")
def _mini_ahead_from(r: Records) -> str:
    starts = []
    for leads in _per_byte_leads(r):
        start = leads[-1][0]
        for b, lead in reversed(leads):
            if lead <= 0:
                break
            start = b
        starts.append(start)
    return f"{max(starts) / MIB:,.0f} MiB"


@fig("mini.per_byte_peak_lead")
def _mini_peak_lead(r: Records) -> str:
    return " / ".join(f"{max(v for _, v in leads):.2f}" for leads in _per_byte_leads(r)) + " nats"


@fig("mini.per_byte_final_lead")
def _mini_final_lead(r: Records) -> str:
    return " / ".join(f"{leads[-1][1]:.2f}" for leads in _per_byte_leads(r)) + " nats"


@fig("mini.spes_final_mib")
def _mini_spes_mib(r: Records) -> str:
    return f"{r('mini_repro')['curves']['spes']['bytes'][-1] / MIB:,.0f} MiB"


@fig("mini.merged_vs_local_220")
def _mini_merged_local(r: Records) -> str:
    c = r("mini_repro")["curves"]["spes"]
    i = c["step"].index(220)
    return f"{c['val_loss'][i]:.3f} vs {c['local_val_loss_mean'][i]:.3f}"


# ---------------------------------------------------------------------------------------------------------------
# 6b. At equal memory per node (mini_repro_memory)


def _mem(r: Records) -> dict[str, Any]:
    return r("mini_repro_memory")


def _mem_final(r: Records, arm: str) -> float:
    return _mem(r)["mean_curves"][arm]["val_loss"][-1]


@fig("memrepro.vs_diloco")
def _memrepro_vs_diloco(r: Records) -> str:
    return f"{rel(_mem_final(r, 'spes_large'), _mem_final(r, 'diloco_small')):+.2%}"


@fig("memrepro.vs_single")
def _memrepro_vs_single(r: Records) -> str:
    return f"{-rel(_mem_final(r, 'spes_large'), _mem_final(r, 'single_small')):.1%}"


@fig("memrepro.end_nats_per_seed")
def _memrepro_nats(r: Records) -> str:
    curves = _mem(r)["curves"]
    return ", ".join(
        f"{curves[s]['spes_large']['val_loss'][-1] - curves[s]['diloco_small']['val_loss'][-1]:+.3f} nats (seed {s})"
        for s in sorted(curves, key=int)
    )


@fig("memrepro.above_from")
def _memrepro_above_from(r: Records) -> str:
    """Per seed, the first evaluated step from which SPES stays above DiLoCo to the end."""
    curves, out = _mem(r)["curves"], []
    for seed in sorted(curves, key=int):
        s, d = curves[seed]["spes_large"], curves[seed]["diloco_small"]
        start = None
        for step, a, b in zip(s["step"], s["val_loss"], d["val_loss"], strict=True):
            start = (start or step) if a > b else None
        out.append(f"step {start} (seed {seed})" if start is not None else f"never (seed {seed})")
    return " and ".join(out)


def _cost(r: Records, arm: str, other: str) -> list[float]:
    m = _mem(r)["mean_curves"]
    return [rel(a, b) for a, b in zip(m[arm]["val_loss"], m[other]["val_loss"], strict=True)]


@fig("memrepro.spes_cost_range")
def _memrepro_cost(r: Records) -> str:
    return span(_cost(r, "spes_large", "diloco_large"), "+.2%")


@fig("memrepro.spes_cost_end_per_seed")
def _memrepro_cost_seed(r: Records) -> str:
    curves = _mem(r)["curves"]
    return ", ".join(
        f"{rel(curves[s]['spes_large']['val_loss'][-1], curves[s]['diloco_large']['val_loss'][-1]):+.2%} (seed {s})"
        for s in sorted(curves, key=int)
    )


def _effect(r: Records, arm: str, other: str) -> str:
    """`arm`'s final loss against `other`'s: the mean of the seeds, each seed's, and whether the seeds agree on its
    sign (an effect smaller than the seeds' disagreement is not one this run measures)."""
    curves = _mem(r)["curves"]
    seeds = sorted(curves, key=int)
    each = [rel(curves[s][arm]["val_loss"][-1], curves[s][other]["val_loss"][-1]) for s in seeds]
    agree = "lower in every seed" if max(each) < 0 else "higher in every seed" if min(each) > 0 else "mixed signs"
    per_seed = ", ".join(f"{e:+.2%} (seed {s})" for e, s in zip(each, seeds, strict=True))
    return f"{rel(_mem_final(r, arm), _mem_final(r, other)):+.2%}: {per_seed}, {agree}"


@fig("memrepro.large_diloco_vs_small")
def _memrepro_large(r: Records) -> str:
    return _effect(r, "diloco_large", "diloco_small")


@fig("memrepro.merge_effect")
def _memrepro_merge(r: Records) -> str:
    return _effect(r, "spes_large", "spes_large_nomerge")


@fig("memrepro.nesterov")
def _memrepro_nesterov(r: Records) -> str:
    return f"{rel(_mem_final(r, 'diloco_nesterov'), _mem_final(r, 'diloco_small')):+.2%}"


@fig("memrepro.total_min")
def _memrepro_total(r: Records) -> str:
    return f"{_mem(r)['run']['total_wall_s'] / 60:.0f} min"


@fig("memrepro.arm_walls")
def _memrepro_walls(r: Records) -> str:
    walls = _mem(r)["walls_s"]
    multi = ("spes_large", "diloco_small", "diloco_nesterov", "diloco_large", "spes_large_nomerge")
    return span((w[a] for w in walls.values() for a in multi if a in w), ".0f", " s")


# ---------------------------------------------------------------------------------------------------------------
# 7-8. Server memory, soak


@fig("server_memory.over_bound")
def _server_over_bound(r: Records) -> str:
    return span((c["peak_over_idle_per_bound"] - 1 for c in r("bench_server_memory")["cases"]), ".0%")


# ---------------------------------------------------------------------------------------------------------------
# 9. Emulated links (bench_wan, bench_wan_gpu)


@fig("wan.efficiency")
def _wan_efficiency(r: Records) -> str:
    return span((m["efficiency"] for m in r("bench_wan")["measurements"]), ".0%")


def _prediction(r: Records, record: str, mbit: float, wire: str, plane: str = "tcp") -> dict[str, Any]:
    return next(
        p for p in r(record)["prediction_1b"] if p["peer_mbit"] == mbit and p["wire"] == wire and p["plane"] == plane
    )


@fig("wan.1b_bytes")
def _wan_1b_bytes(r: Records) -> str:
    bf16, fp32 = (_prediction(r, "bench_wan", 1000.0, w)["bytes_per_peer"] / 1e9 for w in ("bf16", "fp32"))
    return f"{bf16:.2f} GB per peer and round in bf16, {fp32:.2f} GB in fp32"


@fig("wan.cpu_step")
def _wan_cpu_step(r: Records) -> str:
    s = r("bench_wan")["step_measurement_1b"]
    timed = " and ".join(f"{x:.1f}" for x in s["timed_step_seconds"])
    return f"{timed} s for one sequence, so {s['step_s']:,.0f} s for the config's {s['sequences_per_step']} sequences"


@fig("wan.gpu_step")
def _wan_gpu_step(r: Records) -> str:
    s = r("bench_wan_gpu")["step_measurement_1b"]
    timed = ", ".join(f"{x:.2f}" for x in s["timed_step_seconds"])
    tokens = s["sequences_per_step"] * 2048 / s["step_s"]
    return (
        f"{timed} s per optimizer step (median {median(s['timed_step_seconds']):.2f} s), {tokens / 1e3:.0f}k tokens/s"
    )


@fig("wan.gpu_peak")
def _wan_gpu_peak(r: Records) -> str:
    return f"{r('bench_wan_gpu')['step_measurement_1b']['peak_memory_bytes'] / GIB:.1f} GiB"


@fig("wan.gpu_step_s")
def _wan_gpu_step_s(r: Records) -> str:
    return f"{r('bench_wan_gpu')['step_s_1b']:.1f} s"


@fig("wan.gpu_grouped_step_s")
def _wan_gpu_grouped(r: Records) -> str:
    run = next(x for x in r("bench_wan_gpu_steps")["runs"] if x["moe_backend"] == "grouped_mm")
    return f"{run['step_s']:.1f} s"


_GPU_STEP_PREMISES = ("device", "precision", "sequences_per_step", "microbatch")  # what both GPU step records share


@fig("wan.gpu_grouped_speedup")
def _wan_gpu_grouped_speedup(r: Records) -> str:
    """The default backend's 1B step (bench_wan_gpu) over grouped_mm's (bench_wan_gpu_steps): refused unless both
    stepped the same node on the same GPU at the same batch, micro-batch and precision."""
    default, steps = r("bench_wan_gpu"), r("bench_wan_gpu_steps")
    run = next(x for x in steps["runs"] if x["moe_backend"] == "grouped_mm")
    measured = default["step_measurement_1b"]
    premises(
        "grouped_mm against the default backend",
        {
            "bench_wan_gpu": {"config": default["config"], **{k: measured[k] for k in _GPU_STEP_PREMISES}},
            "bench_wan_gpu_steps": {
                "config": steps["config"],
                "device": steps["device"],
                "precision": steps["precision"],
                **{k: run[k] for k in ("sequences_per_step", "microbatch")},
            },
        },
    )
    return f"{default['step_s_1b'] / run['step_s']:.2f}x"


@fig("wan.gpu_train_share_1g_bf16_100")
def _wan_train_share(r: Records) -> str:
    return f"{1 - _prediction(r, 'bench_wan_gpu', 1000.0, 'bf16')['idle_fraction']['100']:.0%}"


@fig("wan.gpu_idle_100m_bf16_100")
def _wan_idle_100m(r: Records) -> str:
    return f"{_prediction(r, 'bench_wan_gpu', 100.0, 'bf16')['idle_fraction']['100']:.0%}"


# ---------------------------------------------------------------------------------------------------------------
# 9b. Overlapped rounds (mini_repro_overlap*, bench_overlap*)


def _arm(r: Records, record: str, arm: str) -> dict[str, Any]:
    return r(record)["arms"][arm]


@fig("overlap.d10_loss")
def _overlap_d10(r: Records) -> str:
    return " and ".join(
        f"{_arm(r, n, 'spes_overlap_d10')['vs_blocking']:+.2%}"
        for n in ("mini_repro_overlap", "mini_repro_overlap_seed7")
    )


@fig("overlap.d10_c05_loss")
def _overlap_c05(r: Records) -> str:
    return " and ".join(
        f"{_arm(r, n, 'spes_overlap_d10_c0.5')['vs_blocking']:+.2%}"
        for n in ("mini_repro_overlap_correction", "mini_repro_overlap_seed7")
    )


@fig("overlap.f5_loss_other_commits")
def _overlap_f5_other_commits(r: Records) -> str:
    """The first fragment arms against blocking arms run at other commits (issue 30: superseded, kept as measured)."""
    return " and ".join(
        f"{_arm(r, n, 'spes_overlap_d2_f5')['vs_blocking']:+.2%}"
        for n in ("mini_repro_overlap_f5", "mini_repro_overlap_f5_seed7")
    )


def _f5_vs_fp32(r: Records, arm: str, names: Sequence[str] = F5_RECORDS) -> str:
    """An arm of the overlapped schedules' comparisons (the newest of `names` that has it, each with its own
    blocking fp32 arm at the same commit) against blocking fp32, in each seed measured (seed 6198's at least)."""
    gaps, seeds = [], []
    for suffix, seed in CODEC_SEEDS.items():
        arms = next((a for a in f5_arms(r, suffix, names) if arm in a), None)
        if arms is None:
            if not suffix:
                raise Missing(names[-1])
            continue
        gaps.append(f"{arms[arm]['vs_fp32']:+.2%}")
        seeds.append(str(seed))
    return f"{' and '.join(gaps)} (seed{'s' * (len(seeds) > 1)} {' and '.join(seeds)})"


def _f5_figure(arm: str, names: Sequence[str] = F5_RECORDS) -> Figure:
    return lambda r: _f5_vs_fp32(r, arm, names)


FIGURES.update(
    {
        "overlap.f5_loss": _f5_figure("spes_overlap_d2_f5"),
        "overlap.f5_int8_loss": _f5_figure("codec_int8_spes_overlap_d2_f5"),
        "overlap.f5_sparse_loss": _f5_figure("codec_sparse_spes_overlap_d2_f5"),
        "overlap.f5_d1_int8_loss": _f5_figure("codec_int8_spes_overlap_d1_f5"),
        "overlap.f5_d1_sparse_loss": _f5_figure("codec_sparse_spes_overlap_d1_f5"),
        "overlap.f5_d1_int8_loss_before_fix": _f5_figure("codec_int8_spes_overlap_d1_f5", [BEFORE_CARRIED_FIX]),
        "overlap.f5_d1_sparse_loss_before_fix": _f5_figure("codec_sparse_spes_overlap_d1_f5", [BEFORE_CARRIED_FIX]),
    }
)


def _same_shape_ratio(r: Records, arm: str, name: str) -> str:
    """An overlapped arm's tokens/s over the blocking fp32 arm's on the mini-reproduction's model and peers (record
    `name`, its pairs in the order AB, BA, AB...)."""
    x = r(name)
    pairs = ", ".join(f"{p['ratios'][arm]:.2f}x" for p in x["pairs"])
    order = ", ".join(("AB", "BA")[i % 2] for i in range(len(x["pairs"])))
    n, ideal = len(x["pairs"]), x["ideal_ratio"]
    return f"{x['ratios'][arm]:.2f}x (median of {n} pairs in the order {order}: {pairs}; ideal {ideal:.2f}x)"


def _ratio_figure(arm: str, name: str = "bench_overlap_f5_same_shape") -> Figure:
    return lambda r: _same_shape_ratio(r, arm, name)


FIGURES.update(
    {
        "overlap.f5_same_shape_ratio": _ratio_figure("overlapped"),
        "overlap.f5_int8_same_shape_ratio": _ratio_figure("overlapped_int8"),
        "overlap.f5_int8_quiet_ratio": _ratio_figure("overlapped_int8", "bench_overlap_f5_int8"),
        "overlap.f5_d1_int8_ratio": _ratio_figure("overlapped_int8", "bench_overlap_f5_d1_int8"),
    }
)


@fig("overlap.f5_d1_cpu")
def _overlap_f5_d1_cpu(r: Records) -> str:
    """Where the CPU went in the overlapped arms of bench_overlap_f5_d1_int8: every core busy. The bound: those CPU
    seconds spread over every core, against the blocking runs' wall time (both the processes' whole lives)."""
    x = r("bench_overlap_f5_d1_int8")
    arms = [p["overlapped_int8"] for p in x["pairs"]]
    cpu = {k: median(a["cpu_s"][k] for a in arms) for k in ("peers", "server", "relay")}
    wall = median(a["process_wall_s"] for a in arms)
    blocking = median(p["blocking"]["process_wall_s"] for p in x["pairs"])
    cores = x["machine"]["cpus"]
    floor = sum(cpu.values()) / cores
    return (
        f"the peers {cpu['peers']:.0f} CPU seconds, the server {cpu['server']:.0f} and the relay {cpu['relay']:.0f} "
        f"in {wall:.0f} s of wall time on {cores} cores ({sum(cpu.values()) / (cores * wall):.0%} of them; medians "
        f"of {len(arms)} runs): with every core busy all the time they would still take {floor:.0f} s, at most "
        f"{blocking / floor:.2f}x the speed of the blocking runs ({blocking:.0f} s)"
    )


def _wan_codec_efficiency(r: Records, name: str) -> str:
    """Each codec's measured round against the emulated link's ideal for its bytes, per link and on which scaled
    model (a record of `bench_wan.py --wires ...`)."""
    by: dict[str, list[str]] = {}
    for m in r(name)["measurements"]:
        by.setdefault(m["wire"], []).append(f"{m['efficiency']:.0%} at {link(m['peer_mbit'])} (1/{m['scale']})")
    return "; ".join(f"{wire}: {', '.join(parts)}" for wire, parts in by.items())


FIGURES["wan.codec_efficiency"] = lambda r: _wan_codec_efficiency(r, "bench_wan_codecs")
FIGURES["wan.codec_efficiency_7bb5219"] = lambda r: _wan_codec_efficiency(r, "bench_wan_codecs_7bb5219")
"""Before 2 MiB pages, and before the peers applied each delta as it arrived (the same run at 7bb5219)."""
FIGURES["wan.codec_efficiency_ab52d67"] = lambda r: _wan_codec_efficiency(r, "bench_wan_codecs_ab52d67")
"""The table's run at ab52d67, before the sparse work of b361a8c and 18d045f."""
FIGURES["wan.codec_efficiency_18d045f"] = lambda r: _wan_codec_efficiency(r, "bench_wan_codecs_18d045f")
"""The table's run at 18d045f, before the sparse selections moved to numpy (17b3cbd)."""
FIGURES["wan.codec_efficiency_b46ff39"] = lambda r: _wan_codec_efficiency(r, "bench_wan_codecs_b46ff39")
"""The same run at b46ff39: the server then decoded each int8 payload twice (fixed in 62ab8a6)."""
FIGURES["wan.codec_efficiency_ab1e2d9"] = lambda r: _wan_codec_efficiency(r, "bench_wan_codecs_ab1e2d9")
"""The same run half an hour earlier, at ab1e2d9 (int8's deltas then applied into kept memory, since undone)."""
FIGURES["wan.codec_efficiency_a319b1b"] = lambda r: _wan_codec_efficiency(r, "bench_wan_codecs_a319b1b")
"""Before the uploads were encoded while sent and applied by the server as they arrived (the same run at a319b1b)."""


def _sparse_work_at_100(r: Records) -> tuple[dict[str, Any], dict[str, float], int, int]:
    """The link table's sparse measurement at 100 Mbit/s, bench_codec's sparse seconds per 1B round (one thread),
    the link machine's cores and the peers: the two records of one config at one commit."""
    wan, codec = r("bench_wan_codecs"), _codec_seconds(r, "bench_codec")
    if codec["config"] != wan["config"] or codec["threads"] != 1 or codec["commit"] != wan["commit"]:
        raise ValueError(
            "bench_codec and bench_wan_codecs must time the same config at the same commit, bench_codec with 1 thread"
        )
    m = next(m for m in wan["measurements"] if m["wire"] == "sparse" and m["peer_mbit"] == 100.0)
    return m, codec["codecs"]["sparse"], wan["machine"]["cpus"], len(m["spes_rounds"][0]["up_per_peer"])


@fig("wan.sparse_cpu_bound")
def _wan_sparse_cpu_bound(r: Records) -> str:
    """The bound the machine puts on the sparse round at 100 Mbit/s: its codec work (bench_codec's 1B seconds per
    round, one thread, divided by the scale the link bench measured) for every peer and the server, spread over
    every core, against the ideal round for its bytes."""
    m, work, cores, peers = _sparse_work_at_100(r)
    seconds = (peers * work["peer_s"] + work["server_s"]) / m["scale"]
    than = "longer than" if seconds / cores > m["ideal_s"] else "within"
    return (
        f"{seconds:.2f} CPU seconds per round for its {peers} peers and the server on the 1/{m['scale']} model, "
        f"{seconds / cores:.2f} s on {cores} cores, {than} the whole ideal round ({m['ideal_s']:.2f} s): at "
        f"most {min(1.0, m['ideal_s'] * cores / seconds):.0%} of the ideal with every byte overlapped"
    )


@fig("wan.sparse_barrier_bound")
def _wan_sparse_barrier_bound(r: Records) -> str:
    """The bound the round's barrier puts on the sparse round at 100 Mbit/s: the server aggregates once every
    upload is in and applied, and the downloads follow, so with e a peer's encode and d the server's apply of the
    P uploads (bench_codec's seconds over the scale, one thread: the codec's work alone), need(.) what the link
    needs for a phase's bytes,

        round >= max((P e + d) / cores, need(up)) + need(down)     (every process sharing the machine's cores)
        round >= max(e, need(up)) + need(down)                     (a core each: a peer encodes while its bytes go)
    """
    m, work, cores, peers = _sparse_work_at_100(r)
    best = min(m["spes_rounds"], key=lambda round_: round_["seconds"])
    up, down = _link_need(m, best["up_per_peer"]), _link_need(m, best["down_per_peer"])
    encode, apply = work["peer_encode_s"] / m["scale"], work["server_decode_s"] / m["scale"]
    shared = max((peers * encode + apply) / cores, up) + down
    own = max(encode, up) + down
    return (
        f"{peers} encodes of {encode:.2f} s and the server's {apply:.2f} s applying them on {cores} cores, then the "
        f"download's {down:.2f} s: at least {shared:.2f} s, at most {m['ideal_s'] / shared:.0%} of the "
        f"{m['ideal_s']:.2f} s ideal at {link(100.0)}; with a core per process at least {own:.2f} s, at most "
        f"{m['ideal_s'] / own:.0%} (1/{m['scale']} model, {r('bench_codec')['commit'][:7]})"
    )


def _wan_sparse_host_round(r: Records, name: str) -> str:
    """The sparse round on the fastest link of a link record against the ideal of the next slower one, at the same
    model scale: a slower link cannot make the round shorter, so the fast link's round bounds the slow one's
    efficiency (the fast link's own ideal being a small part of its round, that round is what the machine needs)."""
    rows = {m["peer_mbit"]: m for m in r(name)["measurements"] if m["wire"] == "sparse"}
    fast, slow = rows.get(1000.0), rows.get(100.0)
    if fast is None or slow is None or fast["scale"] != slow["scale"]:
        raise ValueError(f"{name}: needs sparse at 1 Gbit/s and 100 Mbit/s on one model scale")
    bound = min(1.0, slow["ideal_s"] / fast["spes_s"])
    return (
        f"{fast['spes_s']:.2f} s at {link(1000.0)} (its ideal {fast['ideal_s']:.2f} s), against {slow['ideal_s']:.2f} "
        f"s ideal at {link(100.0)}: there at most {bound:.0%} of the ideal (1/{fast['scale']} model, "
        f"{r(name)['commit'][:7]})"
    )


FIGURES["wan.sparse_host_round"] = lambda r: _wan_sparse_host_round(r, "bench_wan_codecs")
"""The machine's sparse round, measured: the table's record."""


def _link_need(m: dict[str, Any], sizes: list[int]) -> float:
    """What a link measurement's link needs to move one phase's bytes, as `bench_wan.LinkSpec.ideal_seconds` counts
    it: max(slowest peer's bytes / peer rate, all bytes / server rate) + RTT."""
    peer, server = m["peer_mbit"] * 1e6 / 8, m["server_mbit"] * 1e6 / 8
    return max(max(sizes) / peer, sum(sizes) / server) + m["rtt_ms"] / 1000


def _phases_at(m: dict[str, Any]) -> str:
    """A sparse link measurement's fastest timed round, phase by phase (the median over its peers)."""
    best = min(m["spes_rounds"], key=lambda round_: round_["seconds"])
    phases = best["phases_per_peer"]
    if m["wire"] != "sparse" or not phases or None in phases:
        raise ValueError("wan_sparse_phases: every measurement must be sparse, with each peer's phases")
    upload, publish, download = (median(p[key] for p in phases) for key in ("upload_s", "publish_s", "download_s"))
    return (
        f"at {link(m['peer_mbit'])} (1/{m['scale']}, round {best['seconds']:.2f} s, ideal {m['ideal_s']:.2f} s): "
        f"upload {upload:.2f} s (its bytes need {_link_need(m, best['up_per_peer']):.2f} s), publication "
        f"{publish:.2f} s, download {download:.2f} s (its bytes need {_link_need(m, best['down_per_peer']):.2f} s)"
    )


@fig("wan.sparse_phases")
def _wan_sparse_phases(r: Records) -> str:
    """Where the sparse round's seconds go, per link of `wan_sparse_phases` (`spes.sync.client.RoundPhases`, the
    median over the peers), against what the link needs for each transfer's bytes."""
    x = r("wan_sparse_phases")
    return f"{'; '.join(_phases_at(m) for m in x['measurements'])} ({x['commit'][:7]}, medians over the peers)"


def _wan_runs(r: Records, names: Sequence[str], wire: str, speed: float) -> str:
    """One wire at one speed in link records made one after the other (at commits A and B, in the order ABBA): its
    efficiency in each, with the commit that ran it."""
    records = [r(name) for name in names]
    found = [(x["commit"][:7], m) for x in records for m in x["measurements"] if m["peer_mbit"] == speed]
    if len(found) != len(records) or {m["wire"] for _, m in found} != {wire}:
        raise ValueError(f"{', '.join(names)}: each run must measure {wire} at {link(speed)} once")
    premises(
        f"{wire} at {link(speed)}",
        {
            name: {
                **{key: x[key] for key in ("mode", "config", "rounds", "warmup_rounds")},
                "cpus": x["machine"]["cpus"],
                **{key: m[key] for key in ("scale", "plane", "server_mbit", "rtt_ms", "model_bytes_fp32")},
            }
            for name, x, (_, m) in zip(names, records, found)
        },
    )
    runs = ", ".join(f"{m['efficiency']:.0%} at {commit}" for commit, m in found)
    return f"{wire} at {link(speed)} (1/{found[0][1]['scale']}): {runs}"


@fig("wan.pipelining_ab")
def _wan_pipelining_ab(r: Records) -> str:
    """The same link measurement at the commit before the uploads were pipelined and after, in the order the runs
    were made (`wan_ab_<wire>_<n>` records, each of one wire at one speed, on one machine)."""
    return "; ".join(
        _wan_runs(r, [f"wan_ab_{wire}_{n}" for n in range(1, 5)], wire, speed)
        for wire, speed in (("int8", 1000.0), ("sparse", 100.0))
    )


def _wan_sparse_ab(r: Records, names: Sequence[str], speeds: Sequence[float] = (100.0, 20.0)) -> str:
    """Sparse link runs at each of `speeds` at two commits, in the order they were run (ABBA)."""
    return "; ".join(_wan_runs(r, names, "sparse", speed) for speed in speeds)


FIGURES["wan.sparse_apply_ab"] = lambda r: _wan_sparse_ab(
    r, ["wan_sparse_A1", "wan_ab_sparse_c1", "wan_ab_sparse_c2", "wan_ab_sparse_a2"]
)
"""Before and after sparse deltas were applied at the positions they sent (and the server applied uploads into its
kept buffers): 95eb62a, 742001e twice, 95eb62a."""
FIGURES["wan.sparse_defer_ab"] = lambda r: _wan_sparse_ab(
    r, [f"wan_sparse_defer_{n}" for n in ("a1", "b1", "b2", "a2")]
)
"""Before and after the server deferred its re-encoding to the downloads and the chunks' top k were found in two small
selections: 8f5900e, b361a8c twice, 8f5900e."""
FIGURES["wan.sparse_cpu_ab"] = lambda r: _wan_sparse_ab(
    r, [f"wan_sparse_cpu_{n}" for n in ("a1", "b1", "b2", "a2")], (1000.0, 100.0, 20.0)
)
"""Before and after an upload made its first item while the server's go was on its way, the chunks' groups were
strided (the server's top 256 in two selections too) and 8-bit levels were their own bytes: e2eb6fa, 1285f37 twice,
e2eb6fa."""
FIGURES["wan.sparse_host_round_cpu"] = lambda r: "; ".join(
    _wan_sparse_host_round(r, f"wan_sparse_cpu_{n}") for n in ("b1", "b2")
)
"""The machine's sparse round at 1285f37, in both of its link runs."""


@fig("overlap.whole_ratio")
def _overlap_whole_ratio(r: Records) -> str:
    o = r("bench_overlap")
    pairs = " and ".join(f"{p['ratio']:.2f}x" for p in o["pairs"])
    return f"{o['ratio']:.2f}x (median of {len(o['pairs'])} pairs of runs, {pairs})"


@fig("overlap.f5_ratio")
def _overlap_f5_ratio(r: Records) -> str:
    names = ("bench_overlap_f5", "bench_overlap_f5_pair2")
    keys = ("mode", "config", "overrides", "overlap_flags", "fragments", "peers")
    premises(
        "the 5 fragments' pairs", {n: {**{k: r(n)[k] for k in keys}, "rtt_ms": r(n)["link"]["rtt_ms"]} for n in names}
    )
    ratios = [r(n)["ratio"] for n in names]
    return f"{median(ratios):.2f}x (median of 2 pairs, {' and '.join(f'{x:.2f}x' for x in ratios)})"


@fig("overlap.f5_tiny_ratio")
def _overlap_f5_tiny(r: Records) -> str:
    return f"{r('bench_overlap_f5_2layers')['ratio']:.2f}x"


@fig("overlap.f5_by_values_ratio")
def _overlap_f5_values(r: Records) -> str:
    return f"{r('bench_overlap_f5_by_values')['ratio']:.2f}x"


@fig("overlap.loaded_ratios")
def _overlap_loaded(r: Records) -> str:
    return span((p["ratio"] for n in ("bench_overlap_2309", "bench_overlap_2345") for p in r(n)["pairs"]), ".2f", "x")


def _codec_vs_fp32(r: Records, codec: str) -> str:
    """The codec's final loss against fp32 in every seed measured (seed 6198's comparison at least)."""
    gaps, seeds = [], []
    for suffix, seed in CODEC_SEEDS.items():
        try:
            fp32, coded = codec_losses(r, codec, suffix)
        except Missing:
            if not suffix:
                raise
            continue
        gaps.append(f"{rel(coded, fp32):+.3%}")
        seeds.append(str(seed))
    return (
        f"{' and '.join(gaps)} final validation loss against fp32 (seed{'s' * (len(seeds) > 1)} {' and '.join(seeds)})"
    )


def _codec_figure(codec: str) -> Figure:
    return lambda r: _codec_vs_fp32(r, codec)


FIGURES.update({f"codec.{codec}_vs_fp32": _codec_figure(codec) for codec in ("int8", "bf16", "sparse")})


@fig("wan.cpu_max_idle")
def _wan_cpu_max_idle(r: Records) -> str:
    return f"{max(max(p['idle_fraction'].values()) for p in r('bench_wan')['prediction_1b']):.1%}"


@fig("wire.int8_round_times")
def _wire_int8_round_times(r: Records) -> str:
    """A plain int8 round of the 1B with 4 peers through a server link of 1 Gbit/s and 100 Mbit/s (bytes only)."""
    total = 4 * _schemes(r)["spes_int8"]["up_plus_down"] * 8
    return f"about {total / 1e9 / 60:.0f} min at 1 Gbit/s, {total / 1e8 / 60:.0f} min at 100 Mbit/s"


@fig("wire.int8_per_peer")
def _wire_int8_per_peer(r: Records) -> str:
    s = _schemes(r)
    int8, ref, bf16 = (s[k]["up_plus_down"] for k in ("spes_int8", "reference_fp32", "spes_bf16"))
    return (
        f"{int8 / MIB:,.0f} MiB per peer, {int8 / ref:.3f}x the first implementation's fp32 scheme and "
        f"{int8 / bf16:.2f}x bf16's"
    )


@fig("gpu.mb2_peak")
def _gpu_mb2_peak(r: Records) -> str:
    run = min(r("bench_wan_gpu_steps")["runs"], key=lambda x: x["microbatch"])
    return f"micro-batch {run['microbatch']}: {run['peak_memory_gib']:.1f} GiB measured"


@fig("quickstart.stages")
def _quickstart_stages(r: Records) -> str:
    """The README's first command on a fresh clone, stage by stage (bench_quickstart)."""
    x = r("bench_quickstart")

    def took(seconds: float) -> str:
        return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"

    stages = ", ".join(f"{name} {took(s)}" for name, s in x["stages"].items())
    return f"{stages}: {took(x['total_seconds'])} in all on a fresh clone ({x['machine']['cpus']} cores)"


def _codec_seconds(r: Records, name: str, clock: str = "cpu") -> dict[str, Any]:
    """A bench_codec record whose seconds are of `clock` (cpu: the work; wall: what a round waits; records from
    before the choice timed the CPU)."""
    x = r(name)
    if x.get("clock", "cpu") != clock:
        raise ValueError(f"{name}: timed the {x.get('clock', 'cpu')} clock, this figure reads the {clock} clock")
    return x


def _codec_cpu(r: Records, codec: str) -> str:
    x = _codec_seconds(r, "bench_codec")
    c, threads = x["codecs"][codec], x["threads"]
    saved = ", ".join(f"{s:.1f} s at {link}" for link, s in c["saved_s"].items())
    return (
        f"{c['peer_s']:.1f} s on the node and {c['server_s']:.1f} s on the server per round ({threads} thread"
        f"{'s' * (threads > 1)}), against {saved} that its bytes save over fp32"
    )


def _codec_cpu_figure(codec: str) -> Figure:
    return lambda r: _codec_cpu(r, codec)


FIGURES.update({f"codec.{codec}_cpu_1b": _codec_cpu_figure(codec) for codec in ("int8", "sparse")})


@fig("codec.pages")
def _codec_pages(r: Records) -> str:
    """How much longer each codec's round work takes with 4 KiB pages than with the 2 MiB pages spes turns on
    (bench_codec's two processes)."""
    x = r("bench_codec")
    if not x["huge_pages_seen"]:
        raise ValueError("bench_codec: the kernel gave no huge pages, so the record has no ratio of page sizes")
    small = x["pages"]["4 KiB"]["codecs"]

    def times(name: str, c: dict, end: str) -> str:
        return f"x{small[name][f'{end}_s'] / c[f'{end}_s']:.2f}"

    return "; ".join(
        f"{name} {times(name, c, 'peer')} on the node and {times(name, c, 'server')} on the server"
        for name, c in x["codecs"].items()
    )


ENDS = {
    "peer_encode": "the node's encode",
    "peer_decode": "the node's decode",
    "server_encode": "the server's encode",
    "server_decode": "the server's decode",
}


@fig("codec.sparse_select_ab")
def _codec_sparse_select_ab(r: Records) -> str:
    """The sparse codec's encode seconds per 1B round before and after its selections moved to numpy (and a group's
    largest magnitude to max(max, -min)): bench_codec at 5bf0e95, 17b3cbd twice, 5bf0e95, one config and thread."""
    runs = [_codec_seconds(r, f"bench_codec_select_{n}") for n in ("a1", "b1", "b2", "a2")]
    if len({(x["config"], x["threads"], x["repeats"], x["machine"]["cpus"]) for x in runs}) != 1:
        raise ValueError("bench_codec_select_*: the runs differ in config, threads, repeats or machine")
    by_commit: dict[str, list[dict]] = {}
    for x in runs:
        by_commit.setdefault(x["commit"][:7], []).append(x["codecs"]["sparse"])
    if len(by_commit) != 2 or any(len(v) != 2 for v in by_commit.values()) or runs[0]["commit"] != runs[3]["commit"]:
        raise ValueError("bench_codec_select_*: need two runs at each of two commits, in the order ABBA")
    a, b = by_commit.values()

    def one(end: str) -> str:
        seconds = ", ".join(f"{x['codecs']['sparse'][f'{end}_s']:.2f} s at {x['commit'][:7]}" for x in runs)
        ratio = median(c[f"{end}_s"] for c in a) / median(c[f"{end}_s"] for c in b)
        return f"{ENDS[end]} {seconds} ({ratio:.2f}x faster)"

    return f"{one('peer_encode')}; {one('server_encode')}"


@fig("codec.sparse_threads")
def _codec_sparse_threads(r: Records) -> str:
    """What the sparse selections' numpy calls on torch's threads save per 1B round on the wall clock: bench_codec
    --clock wall --serial_selection times the same shapes with them on torch's threads and on one, side by side."""
    x = _codec_seconds(r, "bench_codec_threads", "wall")
    if x["threads"] < 2 or "serial_selection" not in x:
        raise ValueError("bench_codec_threads: needs --threads 2 or more and --serial_selection")
    fast, serial = x["codecs"]["sparse"], x["serial_selection"]["sparse"]

    def one(end: str) -> str:
        return (
            f"{ENDS[end]} {fast[f'{end}_s']:.2f} s against {serial[f'{end}_s']:.2f} s "
            f"({serial[f'{end}_s'] / fast[f'{end}_s']:.2f}x)"
        )

    return f"on {x['threads']} threads, {one('peer_encode')}, {one('server_encode')} ({x['commit'][:7]})"


def _sparse_crossing(r: Records, name: str) -> str:
    """Where the sparse arms' loss against fp32 in record `name` crosses the 1% target, in bits per parameter
    per round."""
    x = r(name)
    arms = sorted(
        ((a["bits_per_param"]["last"], a["vs_fp32"], name) for name, a in x["arms"].items() if "sparse" in name),
        reverse=True,
    )
    within = [a for a in arms if abs(a[1]) <= x["target"]]
    above = [a for a in arms if abs(a[1]) > x["target"]]
    if not within:
        bits, gap, _ = above[0]
        return f"no sparse setting measured reaches {x['target']:.0%}: the densest, {bits:.2f} bits, ends {gap:+.2%}"
    low, high = within[-1], next((a for a in above if a[0] < within[-1][0]), None)
    if high is None:
        return f"every sparse setting measured is within {x['target']:.0%}, down to {low[0]:.2f} bits ({low[1]:+.2%})"
    return (
        f"the curve crosses {x['target']:.0%} between {high[0]:.2f} bits ({high[1]:+.2%}) and {low[0]:.2f} bits "
        f"({low[1]:+.2%}) per parameter per round"
    )


FIGURES.update(
    {
        "codec.sparse_crossing": lambda r: _sparse_crossing(r, "mini_repro_codecs"),
        "codec.sparse_crossing_own": lambda r: _sparse_crossing(r, OWN_BLOCKS),
        "codec.sparse_crossing_dense": lambda r: _sparse_crossing(r, DENSE_SPARSE),
        "codec.sparse_crossing_diloco": lambda r: _sparse_crossing(r, DILOCO_CURVE),
    }
)


@fig("codec.own_blocks")
def _own_blocks(r: Records) -> str:
    """What an owner keeping its own blocks (1da3a8e) changed: each held-model arm's loss against fp32 in the
    newest record before it and in the record after, each comparison's arms at one commit, in each seed measured."""
    before = {  # arm: (what it is, the record before)
        "codec_sparse": ("sparse", "mini_repro_codecs"),
        "codec_sparse_topk1024_down-topk2048": ("sparse at topk 1024", "mini_repro_codecs"),
        "codec_int8_spes_overlap_d2_f5": ("int8 + overlap + 5 fragments", "mini_repro_codecs_f5_held"),
    }
    parts = []
    for suffix, seed in CODEC_SEEDS.items():
        after = r.committed([f"{OWN_BLOCKS}{suffix}"])
        if not after:
            if not suffix:
                raise Missing(OWN_BLOCKS)
            continue
        arms = [(arm, label, r(f"{old}{suffix}")) for arm, (label, old) in before.items() if arm in after[0]["arms"]]
        for arm, label, old in arms:
            premises(
                f"{label} before and after", {"before": _arm_premises(old, arm), "after": _arm_premises(after[0], arm)}
            )
        gaps = [
            f"{label} {old['arms'][arm]['vs_fp32']:+.2%} -> {after[0]['arms'][arm]['vs_fp32']:+.2%}"
            for arm, label, old in arms
        ]
        parts.append(f"seed {seed}: " + ", ".join(gaps))
    return "; ".join(parts)


def _arm_premises(record: dict[str, Any], arm: str) -> dict[str, Any]:
    """What one arm of a mini-reproduction was measured under: its flags, seed, setup and tokens, and its fp32 arm's."""
    return {
        "mode": record["mode"],
        "seed": record["seed"],
        "setup": record["setup"],
        "flags": record["arms"][arm]["flags"],
        "tokens": record["tokens"][arm],
        "fp32_tokens": record["tokens"]["spes"],
    }


@fig("codec.sparse_vs_fp32_diloco")
def _sparse_diloco(r: Records) -> str:
    x = r("mini_repro_codecs_diloco")
    return f"{x['arms']['codec_sparse']['vs_fp32']:+.3%} in the DiLoCo arm (seed {x['seed']})"


@fig("wire.sparse_per_peer")
def _wire_sparse_per_peer(r: Records) -> str:
    """The sparse codec's bytes per peer on the paper's 1B, measured through real servers (bench_wire)."""
    x = r("bench_wire")
    t = wire_measured(r)["sparse"]["totals"]
    params = x["paper_1b"]["model_bytes_fp32"] / 4
    plain, merge, first = (t[k]["up"] + t[k]["down"] for k in ("plain", "merge", "first"))
    bits = f" ({8 * plain / params:.2f} bits per parameter of the model)"
    amortized = (
        x["targets"]["measured_spes_sparse_amortized_over_reference"]
        * x["paper_1b"]["schemes"]["reference_fp32"]["up_plus_down"]
    )
    return (
        f"{plain / MIB:,.0f} MiB per peer in a plain round{bits}, {merge / MIB:,.0f} MiB in a merge round, "
        f"{amortized / MIB:,.0f} MiB averaged over the run's rounds; the first round and a catch-up "
        f"{first / MIB:,.0f} MiB"
    )
