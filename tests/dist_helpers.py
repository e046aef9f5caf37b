"""The one way distributed tests start processes: `torchrun` on N gloo (CPU) ranks, a function or a command.

    results = run_ranks(2, "test_distributed:_frozen_comm_worker", {"strategy": "ddp"}, tmp_path)
    proc = torchrun(2, ["-m", "spes.train", "configs/tiny.yaml", ...], log=tmp_path / "ddp.log")

`run_ranks` runs `<module>:<function>(args: dict, info: DistInfo)` on every rank (the module is imported
from tests/) inside an initialized gloo process group (or NCCL, one GPU per rank, for the GPU tests) and
returns each rank's JSON-able result, rank order. This file is also the script torchrun starts for it. Every
launch has a timeout and its process group is killed on the way out, whatever happened.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from spes.launch import free_port

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

# A node small enough that a torchrun launch is dominated by process start-up (CPU, fp32, no validation).
SMALL_NODE = [
    "--model.d_model=32",
    "--model.n_heads=2",
    "--model.n_layers=2",
    "--model.mlp_hidden_size=64",
    "--model.max_sequence_length=32",
    "--global_train_batch_size=8",
    "--device_train_microbatch_size=2",
    "--precision=fp32",
    "--eval_interval=null",
    "--log_interval=1",
    "--scheduler.t_warmup=2",
]


def child_env(*, gpus: bool = False, **extra: str) -> dict[str, str]:
    """Environment for launched processes: one thread each (2 shared cores), repo importable, unbuffered, and no
    GPU unless `gpus`: the others are CPU (gloo) tests, and on a GPU host N ranks would each claim a GPU it may
    not have."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    path = os.pathsep.join(p for p in (str(REPO), str(TESTS), env.get("PYTHONPATH", "")) if p)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path, **extra)
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_logged(
    cmd: list[str], log: Path, *, timeout: float, env: dict[str, str] | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    """Run `cmd` in `cwd` in its own session with output to `log`; on timeout kill the whole group and fail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env or child_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{' '.join(cmd[:6])} ... did not finish in {timeout:.0f}s; log:\n{_tail(log)}"
            ) from None
        finally:
            _kill_group(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, log.read_text(), "")


def without_torch(cwd: Path, module: str, *argv: str, **env: str) -> tuple[int, str, list[str]]:
    """`python -m MODULE ARGV` in a fresh interpreter (`env` added to its environment): its exit code, stdout and
    stderr's lines, having checked (`-X importtime` names every import, nested ones indented) that it never imported
    torch."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", module, *argv],
        cwd=cwd,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert not re.search(r"\|\s+torch$", proc.stderr, flags=re.M), f"{module} {argv} imported torch"
    return (
        proc.returncode,
        proc.stdout,
        [line for line in proc.stderr.splitlines() if not line.startswith("import time:")],
    )


def torchrun(
    nproc: int,
    args: list[str],
    *,
    log: Path,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone --nproc_per_node=nproc <args>`; with `check`, a non-zero exit fails with the log."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = run_logged(cmd, log, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun exited with {proc.returncode}; log:\n{_tail(log)}")
    return proc


def run_ranks(
    nproc: int,
    target: str,
    args: dict[str, Any],
    out_dir: Path,
    *,
    timeout: float = 120,
    backend: Literal["gloo", "nccl"] = "gloo",
) -> list[Any]:
    """Run `module:function(args, info)` on `nproc` ranks (gloo on the CPU, or NCCL with rank r on GPU r);
    returns their results in rank order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "args.json"
    spec.write_text(json.dumps({"target": target, "args": args, "backend": backend}))
    script = [str(Path(__file__).resolve()), str(out_dir)]
    env = child_env(gpus=backend == "nccl")
    torchrun(nproc, script, log=out_dir / "ranks.log", timeout=timeout, env=env)
    return [json.loads((out_dir / f"result{r}.json").read_text()) for r in range(nproc)]


@contextlib.contextmanager
def parameter_server(log: Path, *args: str, timeout: float = 60) -> Iterator[str]:
    """A real `python -m spes.server` on 127.0.0.1 with a free port; yields "127.0.0.1:port", stops it after."""
    port = free_port()
    cmd = [sys.executable, "-m", "spes.server", "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True, text=True
        )
    try:
        deadline = time.time() + timeout
        while "listening" not in log.read_text():
            if proc.poll() is not None or time.time() > deadline:
                raise AssertionError(f"the parameter server did not start; log:\n{_tail(log)}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


def _rank_main(out_dir: Path) -> None:
    """Inside torchrun: join the group, call the target, write this rank's result."""
    import torch
    import torch.distributed as dist

    from spes.distributed import DistInfo, shutdown_distributed

    spec = json.loads((out_dir / "args.json").read_text())
    module_name, fn_name = spec["target"].split(":")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if spec["backend"] == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(spec["backend"])
    info = DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device)
    ok = False
    try:
        result = getattr(importlib.import_module(module_name), fn_name)(spec["args"], info)
        (out_dir / f"result{info.rank}.json").write_text(json.dumps(result))
        ok = True
    finally:
        gc.collect()  # NOTE: as spes.node.run: a DDP wrapper a reference cycle holds goes before its group does
        shutdown_distributed(clean=ok)


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
