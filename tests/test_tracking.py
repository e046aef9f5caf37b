"""Dashboards: a real training run logs to W&B (offline) and TensorBoard; both are read back from disk."""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import tensorboard_scalars
from disk_helpers import cap_file_size, print_failure, run_child
from spes.atomic import OutOfRoom
from spes.config import TensorBoardConfig, TrainConfig, WandbConfig
from spes.schema import ConfigError
from spes.tracking import TensorBoardTracker, Trackers, WandbTracker, _quiet_writer_threads, olmo_aliases
from spes.train import main

REPO = Path(__file__).resolve().parents[1]


def wandb_records(path: Path) -> list[object]:
    """The protobuf records of a W&B offline run file (a LevelDB-style log: 7-byte file header, then 32 KiB
    blocks of records with a 7-byte header each: crc32, little-endian length, type 1 full / 2-3-4 pieces)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, block, piece = [], 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        piece += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(piece)
            records.append(record)
            piece = b""
    return records


def wandb_history(run_dir: Path) -> tuple[object, dict[int, dict[str, float]]]:
    """(the run record, step -> logged scalars) of the one offline run under `run_dir`."""
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    run, history = None, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[int(items["_step"])] = items
    assert run is not None, f"no run record in {run_file} ({len(history)} history records)"
    return run, history


@pytest.fixture
def fresh_wandb() -> Iterator[None]:
    """W&B keeps the settings of a process's first run for every later one (offline or not, whatever the environment
    says by then): each test that starts a run starts from none, and leaves none behind."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


@pytest.mark.usefixtures("fresh_wandb")
def test_training_run_logs_every_metric_to_wandb_offline_and_tensorboard(
    tiny_corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    args = [
        str(REPO / "configs" / "tiny.yaml"),
        "--using_spes=false",
        *tiny_corpus.overrides(tmp_path / "run"),
        "--max_duration=4st",
        "--eval_interval=2",
        "--save_interval=null",
        "--wandb.project=spes-test",
        "--wandb.name=tiny-node0",
        "--wandb.group=tiny",
        "--wandb.tags=[olmo,spes]",
        f"--tensorboard.log_dir={tmp_path / 'tb'}",
    ]
    assert main(args) == 0
    import wandb

    wandb.teardown()  # NOTE: W&B's own process writes the run file; teardown waits for it to exit, so the file is whole
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4] and "val_loss" in lines[1]

    run, history = wandb_history(tmp_path / "run")
    assert (run.display_name, run.run_group, run.project) == ("tiny-node0", "tiny", "spes-test")
    assert list(run.tags) == ["olmo", "spes"]
    config = {c.key: json.loads(c.value_json) for c in run.config.update}
    assert config["model"]["d_model"] == 64 and config["max_duration"] == "4st"
    scalars = tensorboard_scalars(tmp_path / "tb")
    for record in lines:
        step = record["step"]
        for key, value in record.items():
            if key in ("step", "time") or not isinstance(value, (int, float)):
                continue
            assert history[step][key] == pytest.approx(value), (key, step)
            assert scalars[key][step] == pytest.approx(value, rel=1e-6), (key, step)  # TB stores float32
        # OLMo's names beside spes's, so a dashboard built for the first implementation's runs shows these
        for olmo, value in olmo_aliases(record).items():
            assert history[step][olmo] == pytest.approx(value), (olmo, step)
            assert scalars[olmo][step] == pytest.approx(value, rel=1e-6), (olmo, step)
        assert history[step]["train/CrossEntropyLoss"] == pytest.approx(record["ce"])
        assert history[step]["optim/learning_rate_group0"] == pytest.approx(record["lr"])
    assert scalars["eval/validation/CrossEntropyLoss"][2] == pytest.approx(lines[1]["val_loss"], rel=1e-6)


def test_olmo_aliases_name_what_olmo_logged() -> None:
    record = {
        "ce": 2.0,
        "lb_loss": 0.01,
        "z_loss": 0.002,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens": 4096,
        "tokens_per_s": 800.0,
        "peak_gpu_mb": 1234.5,
        "tokens_per_expert": [[3, 1], [2, 2]],
        "eval/openbookqa/acc_norm": 0.3,
        "eval/piqa/acc": 0.6,
        "eval/spes_heldout_ppl/bits_per_byte": 3.1,
        "sync_s": 1.0,
    }
    aliases = olmo_aliases(record, world_size=4)
    assert aliases == {
        "train/CrossEntropyLoss": 2.0,
        "train/Perplexity": pytest.approx(math.exp(2.0)),
        "train/LoadBalancingLoss": 0.01,
        "train/MoEZLoss": 0.002,
        "optim/learning_rate_group0": 1e-3,
        "optim/total_grad_norm": 0.5,
        "throughput/total_tokens": 4096.0,
        "throughput/device/tokens_per_second": 200.0,
        "System/Peak GPU Memory (MB)": 1234.5,
        "train/TokensTotal/layer0/expert0": 3.0,
        "train/TokensTotal/layer0/expert1": 1.0,
        "train/TokensTotal/layer1/expert0": 2.0,
        "train/TokensTotal/layer1/expert1": 2.0,
        "train/TokensPercentage/layer0/expert0": 75.0,
        "train/TokensPercentage/layer0/expert1": 25.0,
        "train/TokensPercentage/layer1/expert0": 50.0,
        "train/TokensPercentage/layer1/expert1": 50.0,
        "eval/downstream/openbook_qa_len_norm": 0.3,
        "eval/downstream/piqa_acc": 0.6,
    }


def test_trackers_are_off_by_default_and_off_the_main_rank(tmp_path: Path) -> None:
    assert Trackers(TrainConfig(save_folder=str(tmp_path)), enabled=True).trackers == []
    cfg = TrainConfig(save_folder=str(tmp_path), wandb=WandbConfig(), tensorboard=TensorBoardConfig())
    assert Trackers(cfg, enabled=False).trackers == []
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("section, extra", [("wandb", "wandb"), ("tensorboard", "tensorboard")])
def test_missing_package_names_the_extra(
    section: str, extra: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # None in sys.modules makes `import` raise ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    cfg = TrainConfig(
        save_folder=str(tmp_path), **{section: WandbConfig() if section == "wandb" else TensorBoardConfig()}
    )
    with pytest.raises(
        ConfigError,
        match=rf"'{section}' is set but the {extra} package is not installed: "
        rf"pip install -e '\.\[{extra}\]'",
    ):
        Trackers(cfg, enabled=True)


@pytest.mark.usefixtures("fresh_wandb")
def test_wandb_without_an_account_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no stored login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = TrainConfig(save_folder=str(tmp_path / "run"), wandb=WandbConfig(project="p"))
    with pytest.raises(ConfigError, match="W&B could not start: .*WANDB_MODE=offline"):
        Trackers(cfg, enabled=True)


def test_perplexity_is_capped_where_exp_would_overflow_a_dashboard() -> None:
    assert olmo_aliases({"ce": 60.0})["train/Perplexity"] == math.exp(50.0)


class _Recorder:
    """A dashboard (`log(step, metrics)`) or a W&B run (`log(metrics, step=)`) that keeps what it is given."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.closed = 0

    def log(self, *args: object, step: int | None = None) -> None:
        self.logged.append((step, args[0]) if step is not None else args)  # type: ignore[arg-type]

    def close(self) -> None:
        self.closed += 1


def test_trackers_log_olmos_names_per_device_and_close_once(tmp_path: Path) -> None:
    """The node's tokens/s is divided among its ranks for OLMo's per-device figure; closing twice (a run's end,
    then its error path) closes each dashboard once."""
    cfg = TrainConfig(save_folder=str(tmp_path))
    assert Trackers(cfg, enabled=True).world_size == 1
    trackers, recorder = Trackers(cfg, enabled=True, world_size=4), _Recorder()
    trackers.trackers.append(recorder)  # type: ignore[arg-type]
    trackers.log(3, {"tokens_per_s": 800.0, "note": "text"})
    assert recorder.logged == [(3, {"tokens_per_s": 800.0, "throughput/device/tokens_per_second": 200.0})]
    trackers.close()
    trackers.close()
    assert recorder.closed == 1 and trackers.trackers == []


def test_tensorboard_writes_under_the_save_folder_unless_told(tmp_path: Path) -> None:
    tracker = TensorBoardTracker(TrainConfig(save_folder=str(tmp_path), tensorboard=TensorBoardConfig()))
    tracker.close()
    assert tracker.log_dir == tmp_path / "tensorboard" and any(tracker.log_dir.iterdir())


def test_wandb_logs_every_log_interval_steps_and_every_evaluation() -> None:
    tracker, run = object.__new__(WandbTracker), _Recorder()
    tracker.log_interval, tracker.run = 10, run
    for step, metrics in (
        (3, {"loss": 1.0}),
        (3, {"val_loss": 2.0}),
        (4, {"eval/hellaswag/acc": 0.3}),
        (10, {"loss": 3.0}),
    ):
        tracker.log(step, metrics)
    assert run.logged == [(3, {"val_loss": 2.0}), (4, {"eval/hellaswag/acc": 0.3}), (10, {"loss": 3.0})]


@pytest.mark.usefixtures("fresh_wandb")
def test_wandb_starts_in_a_save_folder_not_made_yet_with_the_configs_entity_and_spes_as_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandbTracker(TrainConfig(save_folder=str(tmp_path / "a" / "b"), wandb=WandbConfig(entity="lab")))
    try:
        assert (tracker.run.project, tracker.run.entity) == ("spes", "lab")
        assert (tmp_path / "a" / "b" / "wandb").is_dir()
    finally:
        tracker.close()


def _log_to_tensorboard_past_a_size_limit(log_dir: str) -> None:
    """Child of the test below: TensorBoard event files that stop growing at 1 KiB; the error the logging meets."""
    tracker = TensorBoardTracker(TrainConfig(tensorboard=TensorBoardConfig(log_dir=log_dir)))
    cap_file_size(1024)
    try:
        for step in range(1, 1000):
            tracker.log(step, {"loss": 1.0 / step, "lr": 1e-3})
    except OSError as e:
        print_failure(e)
    try:
        tracker.close()  # after the failure: neither hangs nor prints a traceback
    except OSError as e:
        print(f"close: {e}", file=sys.stderr)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tensorboard_on_a_disk_that_fills_up_fails_in_one_line_naming_its_folder(tmp_path: Path) -> None:
    """The writer thread meets the full disk (here a file-size limit, EFBIG); the next `flush` raises it again: one
    OutOfRoom naming the event files' folder and the fix, with no thread traceback printed above it (there was one,
    then `OSError: [Errno 28] No space left on device` named nothing)."""
    pytest.importorskip("tensorboard")
    log_dir = tmp_path / "tb"
    proc, failure = run_child(
        f"import test_tracking; test_tracking._log_to_tensorboard_past_a_size_limit({str(log_dir)!r})"
    )
    assert failure == {
        "type": "OutOfRoom",
        "errno": errno.EFBIG,
        "message": f"cannot write the TensorBoard event files in {log_dir}: file too large; free space on that disk "
        "or point tensorboard.log_dir at another one, then continue with --resume=auto",
    }, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr, proc.stderr


def test_tensorboard_out_of_room_is_one_error_naming_its_folder_and_the_key_that_sets_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process (the test above meets a real limit in a child): the writer's full disk met by `log` or `close` is
    one OutOfRoom naming the event files' folder, and the fix names the config key that chose it."""
    pytest.importorskip("tensorboard")
    told = TensorBoardTracker(TrainConfig(tensorboard=TensorBoardConfig(log_dir=str(tmp_path / "tb"))))
    default = TensorBoardTracker(TrainConfig(save_folder=str(tmp_path / "run"), tensorboard=TensorBoardConfig()))
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def no_room(*args: object) -> None:
        raise full

    for tracker, key in ((told, "tensorboard.log_dir"), (default, "save_folder")):
        said = (
            f"cannot write the TensorBoard event files in {tracker.log_dir}: no space left on device; free space on "
            f"that disk or point {key} at another one, then continue with --resume=auto"
        )
        monkeypatch.setattr(tracker.writer, "flush", no_room)
        with pytest.raises(OutOfRoom) as logged:
            tracker.log(1, {"loss": 1.0})
        assert (str(logged.value), logged.value.errno, logged.value.__cause__) == (said, errno.ENOSPC, full)
        monkeypatch.undo()
        close = tracker.writer.close
        monkeypatch.setattr(tracker.writer, "close", no_room)
        with pytest.raises(OutOfRoom, match="^cannot write the TensorBoard event files in "):
            tracker.close()
        monkeypatch.undo()
        close()


class _FakeWriterThread:
    """Stands for TensorBoard's writer thread: its class's module, and the error it keeps for the writer's next call."""

    def __init__(self, exception: BaseException | None) -> None:
        self.exception = exception


_FakeWriterThread.__module__ = "tensorboard.summary.writer.event_file_writer"


class _FakeOtherThread:
    """Stands for a thread of TensorBoard's that keeps no error."""


_FakeOtherThread.__module__ = "tensorboard.other"


def test_only_the_error_a_tensorboard_writer_thread_keeps_for_its_caller_is_left_unprinted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hook passes every other thread's error to the hook before it (which prints it): another thread's, a writer
    thread's error it does not keep, an error-less call, a TensorBoard thread that keeps none; installing it twice
    keeps one."""
    seen: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", seen.append)
    _quiet_writer_threads()
    hook = threading.excepthook
    _quiet_writer_threads()
    assert threading.excepthook is hook and hook is not seen.append
    error = OSError(errno.ENOSPC, "No space left on device")

    def args(thread: object, value: BaseException | None) -> threading.ExceptHookArgs:
        return threading.ExceptHookArgs([type(value) if value else None, value, None, thread])  # type: ignore[call-arg]

    kept = args(_FakeWriterThread(error), error)
    hook(kept)
    assert seen == []
    others = [
        args(threading.Thread(), error),
        args(_FakeWriterThread(OSError("another")), error),
        args(_FakeWriterThread(None), None),
        args(_FakeOtherThread(), error),
    ]
    for other in others:
        hook(other)
    assert seen == others
