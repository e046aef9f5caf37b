"""The training loop on a real (small) corpus: exact resume, freezing, accumulation, stop-and-save, bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spes.config import load_config
from spes.distributed import DistInfo
from spes.interrupt import Stopped
from spes.node import build_node
from spes.optim import lr_at, optimizer_state_bytes
from spes.train import main
from spes.trainer import Trainer, aux_loss_factor, schedule_length, scheduler_in_steps

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
QUIET = ["--eval_interval=null", "--log_interval=1000"]


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def centralized(corpus, folder: Path, *extra: str) -> list[str]:  # type: ignore[no-untyped-def]
    return [TINY, "--using_spes=false", *corpus.overrides(folder), *QUIET, *extra]


def test_resume_reproduces_the_uninterrupted_run(  # type: ignore[no-untyped-def]
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """... and names the settings changed since the checkpoint it continues (here the stop it was given); a resume
    with nothing left to do names the setting that says so. A launch that stop_at ended says in its last line that
    the run is unfinished (its `done:` read as a finished run's)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["--max_duration=12st", "--save_interval=6", "--log_interval=1"]
    assert main(centralized(tiny_corpus, straight, *common)) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("done: step 12, ") and last.endswith(" MiB"), last
    assert main(centralized(tiny_corpus, resumed, *common, "--stop_at=6")) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("done: step 6, ") and last.endswith(
        " MiB; stopped at step 6 of 12 (stop_at): the run is unfinished, continue with --resume and a larger stop_at "
        "or none"
    ), last
    assert main(centralized(tiny_corpus, resumed, *common, "--stop_at=6", "--resume")) == 0
    assert "nothing to do: checkpoint is at step 6, stop_at is 6 (max_duration is 12 steps); raise stop_at\n" in (
        capsys.readouterr().out
    )
    assert main(centralized(tiny_corpus, resumed, "--max_duration=6st", "--resume")) == 0
    assert "nothing to do: checkpoint is at step 6, max_duration is 6 steps; raise max_duration\n" in (
        capsys.readouterr().out
    )
    assert main(centralized(tiny_corpus, resumed, *common, "--resume")) == 0
    assert "resuming with 1 setting(s) changed since that checkpoint: stop_at: 6 -> None\n" in capsys.readouterr().out
    a, b = metrics(straight), metrics(resumed)
    assert [r["step"] for r in b] == list(range(1, 13))
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) <= 1e-6, (x["step"], x["loss"], y["loss"])
    wa, wb = load_file(straight / "step12" / "model.safetensors"), load_file(resumed / "step12" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def _node(corpus, tmp_path: Path, *extra: str, log: Callable[[str], None] = lambda _m: None):  # type: ignore[no-untyped-def]
    cfg, _ = load_config(TINY, [*corpus.overrides(tmp_path), *QUIET, "--save_interval=null", *extra])
    node = build_node(cfg, CPU, log=log)
    trainer = Trainer(
        cfg=cfg, model=node.model, optimizer=node.optimizer, loader=node.loader, info=CPU, log=lambda _m: None
    )
    return cfg, node, trainer


def test_spes_node_trains_only_its_own_experts(tiny_corpus, tmp_path: Path) -> None:
    cfg, node, trainer = _node(tiny_corpus, tmp_path, "--spes_config.peer_id=1", "--max_duration=4st")
    before = {n: p.detach().clone() for n, p in node.model.named_parameters()}
    trainer.fit()
    for name, p in node.model.named_parameters():
        changed = not torch.equal(before[name], p.detach())
        if ".experts." in name:
            owned = name.endswith(".1")  # peer 1 owns block 1
            assert p.requires_grad == owned and changed == owned, name
            if not owned:
                assert p.grad is None
        else:
            assert p.requires_grad and changed, name
    trainable = sum(p.numel() for p in node.model.parameters() if p.requires_grad)
    moments = 2 * 4 * trainable  # exp_avg + exp_avg_sq in fp32
    steps = 4 * sum(1 for p in node.model.parameters() if p.requires_grad)  # one fp32 step counter per tensor
    assert optimizer_state_bytes(node.optimizer) == moments + steps


def test_gradient_accumulation_matches_one_big_microbatch(tiny_corpus, tmp_path: Path) -> None:
    """Cross entropy is linear in the micro-batches; the load-balancing loss is not (per micro-batch, as in OLMo)."""
    runs = []
    for micro in (4, 16):
        _, _, trainer = _node(
            tiny_corpus,
            tmp_path / str(micro),
            "--using_spes=false",
            "--max_duration=3st",
            f"--device_train_microbatch_size={micro}",
            "--log_interval=1",
        )
        runs.append(trainer.fit())
    small, big = runs
    assert small[0]["ce"] == pytest.approx(big[0]["ce"], abs=1e-6)
    assert small[0]["grad_norm"] == pytest.approx(big[0]["grad_norm"], rel=1e-3)
    assert [r["ce"] for r in small] == pytest.approx([r["ce"] for r in big], abs=1e-3)


def test_a_run_with_the_instance_filter_and_the_output_z_loss_trains(tiny_corpus, tmp_path: Path) -> None:
    _, _, trainer = _node(
        tiny_corpus,
        tmp_path,
        "--using_spes=false",
        "--data.instance_filter.repetition_max_count=32",
        "--softmax_auxiliary_loss=true",
        "--max_duration=2st",
        "--log_interval=1",
    )
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in trainer.fit())


def test_fused_loss_trains_as_the_whole_logits_loss(tiny_corpus, tmp_path: Path) -> None:
    """`fused_loss`: the head and loss a chunk at a time give the same run, up to the order of the sums."""
    runs = []
    for fused in ("false", "true"):
        _, _, trainer = _node(
            tiny_corpus,
            tmp_path / fused,
            "--using_spes=false",
            f"--fused_loss={fused}",
            "--softmax_auxiliary_loss=true",
            "--max_duration=3st",
            "--log_interval=1",
        )
        runs.append(trainer.fit())
    whole, fused_run = runs
    for key in ("loss", "ce", "grad_norm"):
        assert [r[key] for r in fused_run] == pytest.approx([r[key] for r in whole], rel=1e-4), key


def test_bf16_autocast_trains_on_cpu(tiny_corpus, tmp_path: Path) -> None:
    _, _, trainer = _node(tiny_corpus, tmp_path, "--using_spes=false", "--precision=amp_bf16", "--max_duration=2st")
    history = trainer.fit()
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in history)


def test_duration_in_tokens_is_converted_to_steps() -> None:
    cfg, _ = load_config(TINY, ["--max_duration=2048T"])  # 16 sequences x 64 tokens per step
    assert cfg.max_steps == 2


def test_a_schedule_in_tokens_warms_up_over_that_many_tokens() -> None:
    """`scheduler.units: tokens` counts t_warmup and t_max in tokens (1024 per step of configs/tiny.yaml): a warm-up
    of 2048 tokens is 2 steps, so the rate reaches its peak at step 2, not after 2048 steps."""
    tokens = ["--scheduler.units=tokens", "--scheduler.t_warmup=2048", "--scheduler.t_max=10240", "--max_duration=10st"]
    cfg, _ = load_config(TINY, tokens)
    assert cfg.tokens_per_step == 1024
    sched = scheduler_in_steps(cfg)
    assert (sched.units, sched.t_warmup, schedule_length(cfg)) == ("steps", 2, 10)
    steps, _ = load_config(TINY, ["--scheduler.t_warmup=2", "--max_duration=10st"])
    assert scheduler_in_steps(steps) is steps.scheduler
    peak = cfg.optimizer.learning_rate
    assert [lr_at(s, sched, peak, 10) for s in range(11)] == [lr_at(s, steps.scheduler, peak, 10) for s in range(11)]


def test_a_launch_stopped_early_follows_the_runs_schedules(tmp_path: Path) -> None:
    """stop_at ends a launch, not the run (OLMo): the learning rate's cosine (t_max unset, tokens) and the decayed
    load-balancing ramp (20% of the run) span max_duration; they spanned stop_at's steps."""
    tokens = ["--scheduler.units=tokens", "--max_duration=102400T", "--stop_at=10"]
    cfg, _ = load_config(TINY, tokens)
    assert (cfg.max_steps, cfg.duration_steps, schedule_length(cfg)) == (10, 100, 100)
    spes = ["--spes_config.using_decayed_aux_loss=true", "--spes_config.decayed_factor_update_steps=5"]
    cfg, _ = load_config(TINY, ["--max_duration=100st", "--stop_at=10", *spes])
    assert [aux_loss_factor(cfg, s) for s in (4, 10, 20)] == [1.0, pytest.approx(0.85), 1.0]
    assert aux_loss_factor(load_config(TINY, ["--using_spes=false", *spes])[0], 10) is None


def test_validation_loss_is_logged_before_and_after_nothing_else(tiny_corpus, tmp_path: Path) -> None:
    assert (
        main(
            [
                TINY,
                "--using_spes=false",
                *tiny_corpus.overrides(tmp_path),
                "--max_duration=4st",
                "--eval_interval=2",
                "--eval_subset_num_batches=2",
                "--save_interval=null",
            ]
        )
        == 0
    )
    evals = [r for r in metrics(tmp_path) if "val_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert evals[-1]["val_ppl"] == pytest.approx(torch.tensor(evals[-1]["val_loss"]).exp().item(), rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_saves_a_checkpoint_that_resumes(tiny_corpus, tmp_path: Path) -> None:
    args = centralized(tiny_corpus, tmp_path, "--max_duration=100000st", "--save_interval=null", "--log_interval=1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "spes.train", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.time() + 60
        while not (tmp_path / "metrics.jsonl").exists() and time.time() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    latest = (tmp_path / "latest").read_text().strip()
    step = int(latest.removeprefix("step"))
    assert step >= 1 and "--resume" in out
    assert main(centralized(tiny_corpus, tmp_path, f"--max_duration={step + 1}st", "--resume")) == 0
    assert (tmp_path / f"step{step + 1}").is_dir()


@pytest.mark.parametrize("save_interval", [2, 3])
def test_a_stop_saves_its_step_once(tiny_corpus, tmp_path: Path, save_interval: int) -> None:
    """A stop request on a `save_interval` step does not write that checkpoint a second time."""
    _, _, trainer = _node(
        tiny_corpus, tmp_path, "--using_spes=false", "--max_duration=10st", "--no_pre_train_checkpoint=true"
    )
    trainer.cfg.save_interval = save_interval
    saved: list[int] = []
    save = trainer.save
    trainer.save = lambda unsharded=False: (saved.append(trainer.step), save(unsharded))[1]  # type: ignore[method-assign]
    trainer._stop_requested = lambda _stop, _late: (trainer.step == 2, False)  # type: ignore[method-assign]
    with pytest.raises(Stopped) as stopped:
        trainer.fit()
    assert stopped.value.code == 130 and stopped.value.step == 2 and saved == [2]
    assert (tmp_path / "latest").read_text().strip() == "step2"


def test_off_fsdp_save_interval_keeps_do_not_prune_the_unsharded_schedules_checkpoints(
    tiny_corpus, tmp_path: Path
) -> None:
    """The first implementation's node files keep 1 of save_interval's and 5 of save_interval_unsharded's; on one
    process both write step<N>/, and each save_interval save deleted every unsharded one but itself."""
    _, _, trainer = _node(
        tiny_corpus,
        tmp_path,
        "--using_spes=false",
        "--max_duration=6st",
        "--save_interval=4",
        "--save_num_checkpoints_to_keep=1",
        "--save_interval_unsharded=2",
        "--save_num_unsharded_checkpoints_to_keep=3",
    )
    trainer.fit()
    assert sorted(p.name for p in tmp_path.glob("step*")) == ["step2", "step4", "step6"]


def test_bad_inputs_exit_2_with_one_line(tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cases = [
        ([str(tmp_path / "missing.yaml")], "config file not found"),
        ([TINY, "--model.d_mdoel=3"], "did you mean 'model.d_model'"),
        ([TINY, "--model.n_layers=two"], "'model.n_layers' = 'two'"),
        (
            [
                TINY,
                "--using_spes=false",
                *tiny_corpus.overrides(tmp_path),
                "--model.vocab_size=999",
                "--model.embedding_size=999",
            ],
            "vocab",
        ),
    ]
    for argv, expected in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert expected in err and len(err.splitlines()) == 1, err


def test_corrupt_checkpoint_is_refused_and_older_ones_untouched(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args = centralized(tiny_corpus, tmp_path, "--max_duration=4st", "--save_interval=2")
    assert main(args) == 0
    good = (tmp_path / "step2" / "model.safetensors").read_bytes()
    target = tmp_path / "step4" / "model.safetensors"
    target.write_bytes(target.read_bytes()[:100])
    assert main([*args, "--max_duration=6st", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "step4/model.safetensors" in err and "corrupt" in err
    assert (tmp_path / "step2" / "model.safetensors").read_bytes() == good


def test_a_centralized_checkpoint_seeds_a_spes_node(tiny_corpus, tmp_path: Path) -> None:
    """Expert blocks are re-blocked across layouts; the SPES node starts at step 0 from those weights, and says
    that only the weights came along."""
    central = tmp_path / "central"
    assert main(centralized(tiny_corpus, central, "--max_duration=2st", "--save_interval=2")) == 0
    logged: list[str] = []
    extra = (f"--load_path={central}", "--max_duration=1st")
    cfg, node, trainer = _node(tiny_corpus, tmp_path / "spes", *extra, log=logged.append)
    assert (
        f"loaded only the weights of {central / 'step2'}: it has another expert layout, re-blocked to this run's; its "
        "optimizer and trainer state fit only its own layout, so this run starts at step 0 with a fresh optimizer, "
        "the data from the start and the learning-rate schedule (warm-up included) from its beginning"
    ) in logged and not any(m.startswith("loaded ") and "(step" in m for m in logged), logged
    assert node.optimizer.state == {}
    saved = load_file(central / "step2" / "model.safetensors")
    assert torch.equal(torch.cat(list(node.model.blocks[0].ffn.experts.w1)), saved["blocks.0.ffn.experts.w1.0"])
    assert node.checkpoint is not None and node.checkpoint.trainer == {}
    assert [p.requires_grad for p in node.model.blocks[0].ffn.experts.w1] == [True, False, False, False]


def test_a_resume_into_another_expert_layout_is_refused(  # type: ignore[no-untyped-def]
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Resuming a centralized run's folder as a SPES node would start a new run at step 0 among the old run's
    checkpoints (a later resume would pick the old run's): refused, naming the layout's settings that changed and the
    layout (not a longer max_duration, which a resume may set), and nothing written."""
    args = centralized(tiny_corpus, tmp_path, "--max_duration=2st", "--save_interval=2")
    assert main(args) == 0
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main([*args, "--using_spes=true", "--max_duration=4st", "--resume"]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: {tmp_path / 'step2'} holds this save_folder's run with another expert layout (using_spes: False -> "
        "True: this run stores each MoE layer's 8 experts in blocks of 2): a resume continues that run as it was "
        f"saved; to start this layout from its weights, choose another save_folder with --load_path="
        f"{tmp_path / 'step2'}"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_tokens_per_expert_are_logged_per_layer_when_asked(tiny_corpus, tmp_path: Path) -> None:
    """model.moe_log_expert_assignment: every routed token copy of a step counted once, per layer and expert."""
    on, off = tmp_path / "on", tmp_path / "off"
    common = ["--max_duration=2st", "--log_interval=1", "--save_interval=null"]
    assert main(centralized(tiny_corpus, on, *common, "--model.moe_log_expert_assignment=true")) == 0
    assert main(centralized(tiny_corpus, off, *common)) == 0
    cfg, _ = load_config(TINY, ["--using_spes=false"])
    inputs = cfg.global_train_batch_size * (cfg.model.max_sequence_length - 1)  # a window's last token is only a label
    for row in metrics(on):
        counts = row["tokens_per_expert"]
        assert len(counts) == cfg.model.n_layers and all(len(c) == cfg.model.moe_num_experts for c in counts)
        assert all(sum(c) == inputs * cfg.model.moe_top_k for c in counts), counts
    assert all("tokens_per_expert" not in row for row in metrics(off))
    assert [r["loss"] for r in metrics(on)] == [r["loss"] for r in metrics(off)]


def test_step_0_checkpoint_is_written_only_when_asked(tiny_corpus, tmp_path: Path) -> None:
    """no_pre_train_checkpoint=false saves the initial weights as step0 before the first step, without changing the
    run (torch would create Adam's state with a step of its own if asked for it), and a run from it is the same run."""
    ask, default = tmp_path / "ask", tmp_path / "default"
    common = ["--max_duration=2st", "--save_interval=2"]
    assert main(centralized(tiny_corpus, ask, *common, "--no_pre_train_checkpoint=false")) == 0
    assert main(centralized(tiny_corpus, default, *common)) == 0
    assert [p.name for p in sorted(ask.glob("step*"))] == ["step0", "step2"]
    assert [p.name for p in sorted(default.glob("step*"))] == ["step2"]
    meta = json.loads((ask / "step0" / "meta.json").read_text())
    assert meta["step"] == 0 and meta["trainer"]["step"] == 0
    w0, w2 = load_file(ask / "step0" / "model.safetensors"), load_file(ask / "step2" / "model.safetensors")
    assert any(not torch.equal(w0[k], w2[k]) for k in w0)
    assert not (ask / "step0" / "optim.safetensors").exists()  # no optimizer state before the first step
    resumed = tmp_path / "resumed"
    assert main(centralized(tiny_corpus, resumed, *common, f"--load_path={ask / 'step0'}")) == 0
    assert metrics(ask)[-1]["loss"] == metrics(resumed)[-1]["loss"] == metrics(default)[-1]["loss"]


@pytest.mark.parametrize("max_grad_norm", [1e-3, None])
def test_the_optimizer_steps_on_the_clipped_gradient(tiny_corpus, tmp_path: Path, max_grad_norm: float | None) -> None:
    """`max_grad_norm` bounds the global norm of the gradient the optimizer reads (seen from its step pre-hook);
    the logged grad_norm stays the norm before clipping. None: the gradient reaches the optimizer as computed."""
    _, _, trainer = _node(
        tiny_corpus,
        tmp_path,
        "--using_spes=false",
        "--max_duration=2st",
        f"--max_grad_norm={max_grad_norm if max_grad_norm else 'null'}",
    )
    seen: list[float] = []

    def global_norm(optimizer: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        seen.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())

    trainer.optimizer.register_step_pre_hook(global_norm)
    raw = trainer.train_step(next(iter(trainer.loader)))["grad_norm"]
    assert raw > 0.1  # far above 1e-3: the clip really bites
    assert seen == [pytest.approx(raw if max_grad_norm is None else max_grad_norm, rel=1e-4)]


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_a_run_resumed_on_cuda_continues_the_cuda_random_stream(tiny_corpus, tmp_path: Path) -> None:
    """The trainer's state holds the CUDA generator's too (what dropout or sampling on the GPU draws): a node resumed
    from a checkpoint draws on the GPU exactly what the run would have drawn next had it not stopped. The first run
    draws before training, so a resume that kept the freshly seeded generator would draw something else."""
    cuda = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))

    def trainer_on_cuda(*extra: str) -> Trainer:
        cfg, _ = load_config(TINY, [*tiny_corpus.overrides(tmp_path), "--using_spes=false", *QUIET, *extra])
        node = build_node(cfg, cuda, log=lambda _m: None)
        trainer = Trainer(
            cfg=cfg, model=node.model, optimizer=node.optimizer, loader=node.loader, info=cuda, log=lambda _m: None
        )
        if node.checkpoint is not None:
            trainer.load_state_dict(node.checkpoint.trainer)
        return trainer

    first = trainer_on_cuda("--max_duration=2st", "--save_interval=2")
    torch.rand(1000, device=cuda.device)  # the generator moves past where a fresh seed puts it
    first.fit()
    next_draw = torch.rand(1000, device=cuda.device)
    resumed = trainer_on_cuda("--max_duration=4st", "--save_interval=null", f"--load_path={tmp_path}")
    assert resumed.step == 2
    assert torch.equal(torch.rand(1000, device=cuda.device), next_draw)


def test_the_console_counts_the_runs_steps_and_paces_its_eta_by_the_wall_clock(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch cut short by stop_at reads `step 2/4 ... (stop_at 2)`, not `step 2/2` (lr and schedules span the
    run's 4); the ETA counts the time outside the training steps (here a slow evaluation, over the internet a
    round), which tokens/s leaves out."""
    pause = 0.25
    monkeypatch.setattr(Trainer, "evaluate", lambda self: time.sleep(pause) or 1.0)
    args = ["--max_duration=4st", "--stop_at=3", "--eval_interval=1", "--log_interval=1", "--save_interval=null"]
    assert main([TINY, "--using_spes=false", *tiny_corpus.overrides(tmp_path), *args]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" [")[0] for line in lines] == ["step 1/4", "step 2/4", "step 3/4"]
    assert lines[-1].split(" | ")[0] == "step 3/4 [###############.....]  75% (stop_at 3)"
    assert all(re.search(r" \| eta \d+:\d\d:\d\d$", line) for line in lines) and lines[-1].endswith(" 0:00:00")
    eta = [r["eta_min"] * 60 for r in metrics(tmp_path)]
    assert eta[0] >= 2 * pause and eta[1] >= pause and eta[2] == 0.0
