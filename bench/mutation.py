"""Mutation testing of the core pure modules: how many small planted bugs their own tests catch, module by module.

    .venv/bin/python bench/mutation.py                     # every module of MODULES, one after the other
    .venv/bin/python bench/mutation.py spes/optim.py       # only these (the record keeps the other modules' results)
    .venv/bin/python bench/mutation.py --list              # the modules and the tests that cover each

Not run in CI: a module takes minutes to an hour on 2 cores. mutmut (the `dev` extra) mutates one module in a scratch
copy of the repository and runs, for each mutant, the tests of MODULES[module] that exercised the mutated function,
one mutant at a time (the machine is shared); a module's run stops after --timeout_min. The record
(bench/results/mutation.json) holds per module the run that produced it (command, commit, machine), its score
(killed / mutants), the mutants per status, and every mutant not killed with its location and diff; those in
EQUIVALENT carry the reason no test can kill them. docs/testing.md says how to read it and when to run it.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO_ROOT, RESULTS_DIR, command_line, git_commit, machine_info
from spes.atomic import write_atomic

COMPILED_HEAD = "tests/test_head_loss.py::test_compiled_chunk_fns_compute_what_the_plain_ones_do"
SYNC_COUNTED = tuple(
    f"tests/test_speed.py::{name}"
    for name in (
        "test_a_grouped_mm_step_waits_for_the_device_once",
        "test_the_loop_backend_waits_once_per_layer_and_micro_batch",
        "test_logging_expert_counts_adds_one_sync_per_step",
    )
)
"""The tests that count a step's host-device syncs through spes.speed.SyncCounter."""
HANDLER_TESTS = (
    "tests/sync/test_coordinator.py",
    "tests/sync/test_joins.py",
    "tests/sync/test_closing.py",
    "tests/sync/test_plane_grpc.py",
    "tests/sync/codecs/test_held.py",
)
HELD_30_ROUNDS = (
    "--deselect=tests/sync/codecs/test_held.py::test_error_feedback_keeps_what_was_not_sent_over_30_rounds[sparse]",
    "--deselect=tests/sync/codecs/test_held.py::test_error_feedback_keeps_thirty_int8_rounds_within_one_step_of_the_lossless_sum",
)
"""Two of test_held.py's 30-round runs: they triple a mutant's time and run the same lines as the int8 one."""
TORCH_FREE_CHILDREN = tuple(
    f"--deselect=tests/{test}"
    for test in (
        "test_hf.py::test_help_and_a_refused_command_line_are_answered_without_torch",
        "test_upcycle.py::test_help_and_a_refused_command_line_or_config_are_answered_without_torch",
        "test_hf.py::test_a_mistyped_flag_is_named_in_the_refusal_for_the_flag_it_meant",
    )
)
"""Tests of a command line in a fresh interpreter (`without_torch`): under mutmut's trampolines the child fails
the check, and mutmut credits no child process's calls anyway."""

MODULES: dict[str, tuple[str, ...]] = {
    "spes/guard.py": (
        "tests/test_guard.py::test_all_finite_and_the_first_bad_parameter",
        "tests/test_guard.py::test_non_finite_weights_are_refused_naming_the_first_and_what_was_refused",
        "tests/test_guard.py::test_skips_count_only_bad_steps_in_a_row",
    ),
    "spes/optim.py": ("tests/test_optim.py",),
    # the held model through its production classes, the wire and a server's handlers in-process: every test of
    # test_held.py but two of the 30-round ones (they triple a mutant's time and run the same lines as the int8 one)
    "spes/sync/codecs/held.py": (
        "tests/sync/codecs/test_held.py",
        *HELD_30_ROUNDS,
        "tests/sync/codecs/test_int8.py",
        "tests/sync/codecs/test_sparse.py",
        "tests/sync/codecs/test_codecs_fuzz.py",
        # a peer taking full values of a round it took part in, from a restarted server
        "tests/sync/test_restarts.py::test_a_peer_that_had_not_downloaded_the_last_round_before_the_restart_gets_it_as_if_never_stopped",
    ),
    "spes/sync/codecs/int8.py": ("tests/sync/codecs/test_int8.py", "tests/sync/codecs/test_codecs_fuzz.py"),
    "spes/sync/codecs/sparse.py": ("tests/sync/codecs/test_sparse.py", "tests/sync/codecs/test_codecs_fuzz.py"),
    "spes/sync/fragments.py": ("tests/sync/test_fragments.py",),
    "spes/sync/merge.py": ("tests/sync/test_merge.py",),
    "spes/sync/overlap.py": ("tests/sync/test_overlap.py",),
    "spes/sync/rounds.py": ("tests/sync/test_rounds.py",),
    # the generated stubs' check runs protoc in a scratch copy of run_scripts/: nothing of wire.py
    # the TLS contexts and the handshake probe, the probe against listeners and real servers on loopback
    "spes/sync/channel.py": ("tests/sync/test_channel.py", "tests/sync/test_connection.py"),
    "spes/sync/wire.py": (
        "tests/sync/test_wire.py",
        "tests/sync/test_wire_fuzz.py",
        "--deselect",
        "tests/sync/test_wire.py::test_committed_stubs_are_up_to_date",
    ),
    # NOTE: a test that runs torch.compile fails in mutmut's forked children whatever the mutant (every mutant of what
    # it calls then counted killed); it is run on its own for the mutants it exists for (KILLED_BY)
    "spes/head_loss.py": ("tests/test_head_loss.py", "--deselect", COMPILED_HEAD),
    "spes/objective.py": ("tests/test_objective.py",),
    "spes/moe.py": ("tests/test_moe.py",),
    # shards at URLs too: opened from a loopback HTTP server, pickled to loader workers
    "spes/data.py": ("tests/test_data.py", "tests/test_remote_ranges.py", "tests/test_checkpoint_fuzz.py"),
    "spes/shards.py": (
        "tests/test_shards.py",
        "tests/test_shards_fuzz.py",
        "tests/test_data.py",
        "tests/test_remote_files.py",
        "tests/test_remote_ranges.py",
    ),
    "spes/hub.py": ("tests/test_hub.py",),
    "spes/cli.py": ("tests/test_cli.py",),
    "spes/sync/retry.py": ("tests/sync/test_retry.py",),
    "spes/sync/stalls.py": ("tests/sync/test_stalls.py", "tests/sync/test_retry.py", "tests/sync/test_rounds.py"),
    "spes/sync/protocol.py": ("tests/sync/test_protocol.py", "tests/sync/test_retry.py"),
    "spes/monitor.py": ("tests/test_monitor.py",),
    "spes/sync/codecs/registry.py": ("tests/sync/codecs/test_registry.py",),
    "spes/sync/settings.py": ("tests/sync/test_settings.py", "tests/test_server_cli.py"),
    "spes/sync/status.py": ("tests/sync/test_status.py",),
    "spes/sync/presence.py": ("tests/sync/test_presence.py",),
    "spes/tokenizer.py": ("tests/test_tokenizer.py",),
    "spes/sync/throttle.py": ("tests/sync/test_throttle.py",),
    "spes/sync/aggregate.py": ("tests/sync/test_aggregate.py", "tests/sync/test_coordinator.py"),
    "spes/sync/auth.py": (
        "tests/sync/test_auth.py",
        "tests/sync/test_client.py::test_tls_peer_ids_bind_each_peer_to_its_certificate",
    ),
    "spes/sync/spec.py": ("tests/sync/test_spec.py",),
    "spes/sync/admission.py": (
        "tests/sync/test_admission.py",
        "tests/sync/test_client.py::test_tls_peer_ids_bind_a_presence_stream_to_its_certificate",
    ),
    "spes/atomic.py": ("tests/test_atomic.py",),
    "spes/sync/codecs/raw.py": ("tests/sync/codecs/test_raw.py",),
    "spes/sync/buffers.py": ("tests/sync/test_buffers.py",),
    "spes/sync/state.py": ("tests/sync/test_state.py", "tests/sync/test_state_fuzz.py"),
    # the kill-during-save and resume-on-other-ranks runs are processes of their own (mutmut credits none of them)
    "spes/checkpoint.py": ("tests/test_checkpoint.py", "tests/test_checkpoint_fuzz.py", "-m", "not slow"),
    "spes/save_folder.py": ("tests/test_save_folder.py", "tests/test_checkpoint.py", "-m", "not slow"),
    "spes/config.py": ("tests/test_config.py",),
    "spes/schema.py": ("tests/test_schema.py", "tests/test_config.py"),
    # the coordinator's handlers, driven in-process: straight, and through in-process servers on loopback (the gRPC
    # plane's handlers, and the held-model codecs whose uploads apply to the latest round)
    "spes/sync/joins.py": (
        "tests/sync/test_joins.py",
        "tests/sync/test_joins_fuzz.py",
        "tests/sync/test_coordinator.py",
    ),
    # the round service itself (joins, streams, status, presence, shutdown, the rounds' log line): straight, through
    # the handlers' tests and in-process servers on loopback; not the server processes (slow: mutmut credits none), the
    # held model's 30-round runs, the gRPC ride-out of a stop (the TCP one runs the same lines), a throughput figure
    # and the client's retries before a server is up (neither asks the coordinator anything)
    "spes/sync/coordinator.py": (
        *HANDLER_TESTS,
        "tests/sync/test_server.py",
        "tests/sync/test_shutdown.py",
        "tests/sync/test_client.py",
        "-m",
        "not slow",
        *HELD_30_ROUNDS,
        "--deselect=tests/sync/test_shutdown.py::test_a_peer_rides_out_a_server_stopped_mid_round_and_the_run_goes_on[grpc]",
        "--deselect=tests/sync/test_client.py::test_loopback_throughput",
        "--deselect=tests/sync/test_client.py::test_client_retries_until_the_server_comes_up",
    ),
    # what a codec serves after a round (`Served`: the tensors it keeps alive, its deferred items made): the codecs
    # that serve through it, straight and through in-process servers, and the round state that holds it
    "spes/sync/codecs/interface.py": (
        "tests/sync/codecs/test_held.py",
        *HELD_30_ROUNDS,
        "tests/sync/codecs/test_raw.py",
        "tests/sync/codecs/test_lazy.py",
        "tests/sync/test_rounds.py",
        "tests/sync/test_closing.py",
    ),
    "spes/sync/uploads.py": HANDLER_TESTS,
    "spes/sync/downloads.py": HANDLER_TESTS,
    "spes/sync/closing.py": HANDLER_TESTS,
    # the forward's numerics against transformers' own models (RoPE, norms, QK-norm kinds, GQA, renormalization)
    "spes/model.py": ("tests/test_model.py", "tests/test_hf.py::test_export_logits_match_transformers"),
    # the step timing and its figures (tokens/s, MFU) that the GPU benchmark and `preflight --gpu` share; the sync
    # counter's tests fail in mutmut's runs whatever the mutant (it counts calls by their callers' frames, and mutmut
    # puts its own between them): they are run on their own for the mutants they exist for (KILLED_BY)
    "spes/speed.py": (
        "tests/test_speed.py",
        *(arg for test in SYNC_COUNTED for arg in ("--deselect", test)),
    ),
    # token files by URL, against an HTTP server on loopback in the test's own process
    "spes/remote_files.py": ("tests/test_remote_files.py",),
    "spes/remote_ranges.py": ("tests/test_remote_ranges.py",),
    # the dashboards: OLMo's metric names, W&B offline and TensorBoard event files
    "spes/tracking.py": ("tests/test_tracking.py",),
    # checkpoints to and from Hugging Face models: bit-exact round trips, logits against transformers' own models,
    # the refusals; a Hub id through an endpoint on loopback
    "spes/hf_map.py": ("tests/test_hf.py", "tests/test_upcycle.py", "tests/test_hub.py", *TORCH_FREE_CHILDREN),
    "spes/hf_convert.py": ("tests/test_hf.py", "tests/test_upcycle.py", "tests/test_hub.py", *TORCH_FREE_CHILDREN),
    "spes/upcycling.py": ("tests/test_upcycle.py", "tests/test_hub.py", *TORCH_FREE_CHILDREN),
    # their command lines, through main in the test's own process (not the torch-free children: mutmut credits none)
    "spes/hf.py": ("tests/test_hf.py", *TORCH_FREE_CHILDREN),
    "spes/upcycle.py": ("tests/test_upcycle.py", "tests/test_hub.py", *TORCH_FREE_CHILDREN),
    "spes/sync/codecs/lazy.py": ("tests/sync/codecs/test_lazy.py",),
    # what a node checkpoint holds for the sync wing (the run record, a round in flight, the codec's state), its
    # readers fuzzed; not the peer's restarts that write them (servers and training loops, minutes a mutant)
    "spes/sync/node_files.py": ("tests/sync/test_node_files.py", "tests/sync/test_node_files_fuzz.py"),
    # the node checks' report lines and matmul rate (the block smoke's compiled variant: see COMPILED_HEAD's note)
    "spes/checks.py": (
        "tests/test_checks.py",
        "tests/test_preflight.py",
        "tests/test_gpu_check.py",
        "-m",
        "not slow",
        "--deselect",
        "tests/test_gpu_check.py::test_the_block_smoke_compiles_the_block_when_the_config_does",
    ),
    # tokenizing into shards and training a tokenizer, on real files with a real tokenizer; not the killed CLI run
    # (a process of its own, which mutmut credits nothing; the in-process interrupted run covers the same writer)
    "spes/corpus.py": ("tests/test_tokenize_data.py", "tests/test_tokenizer.py", "-m", "not slow"),
    # the `evaluators:` entries and the lm-eval runs; not the training run that scores real tasks (minutes a mutant)
    "spes/evaluators.py": ("tests/test_evaluators.py", "-m", "not slow"),
    # signals sent to the test's own process; not the interrupted multi-node runs (processes of their own)
    "spes/interrupt.py": ("tests/test_interrupt.py", "-m", "not slow"),
    # a failed run's line, exit code and kept traceback, through spes.train's main in the test's own process
    "spes/failures.py": ("tests/test_failures.py",),
    # `python -m spes.status` through its main, against real servers on loopback (TLS files, tokens, refusals)
    # NOTE: the pipe test runs the command in a child process, which mutmut cannot credit (`KILLED_BY` runs it)
    "spes/status.py": ("tests/test_status_cli.py", "-k", "not through_a_pipe"),
    # the node's decisions called directly (save folder, checkpoint to start from, trainer state, data checks, the
    # rounds a rejoin takes) and its in-process runs through spes.train's main (refusals, a rewind, a dry run, a signal
    # before the loop, a server's dry join on loopback), and a checkpoint of another expert layout (test_trainer.py's);
    # not the `python -m spes.train` children or torchrun runs (slow: mutmut credits no process of their own)
    "spes/node.py": (
        "tests/test_node.py",
        "tests/test_trainer.py::test_a_centralized_checkpoint_seeds_a_spes_node",
        "tests/test_trainer.py::test_a_resume_into_another_expert_layout_is_refused",
        "-m",
        "not slow",
    ),
}
"""Each core pure module and the pytest arguments that select its covering tests: fast, in-process, no corpus to
build (the tests mutmut runs for a mutant are those of these that called the mutated function)."""


def mutants(function: str, numbers: str, what: str) -> dict[str, str]:
    """`what` for each of the mutants `numbers` (space-separated) of `function`, as mutmut names it
    (`spes.optim.x_lr_at`: module, then x_ and the function; a method: xǁClassǁmethod)."""
    return {f"{function}__mutmut_{n}": what for n in numbers.split()}


_CPU_OFFLOAD = (
    "cpu_offload of a whole (full_state_dict) state: where its tensors land and whether rank 0 alone holds them, "
    "on machines whose tensors are all on the CPU already; only the gather's memory differs, which no test measures"
)
_UTF8 = (
    "the encoding of a JSON file: json.dumps writes ASCII (ensure_ascii), 'UTF-8' is 'utf-8', and Python reads "
    "files as UTF-8 under a UTF-8 locale (the C locale is coerced to one, PEP 538)"
)
_NONE_DEFAULT = "an optional flag's default=None: argparse's default already"
_SETDEFAULT = "setdefault(key) stores None, as setdefault(key, None): the dict is an ordered set"
EQUIVALENT: dict[str, str] = {
    **mutants(
        "spes.remote_ranges.x__get",
        "8 12 13",
        "the case of a method or header name: urllib3 sends the method upper-cased, and HTTP header names are "
        "read without case",
    ),
    **mutants(
        "spes.remote_ranges.x__total",
        "8 9 15 16",
        "the case of a header name: urllib3's response headers are looked up without case",
    ),
    **mutants(
        "spes.failures.x_report",
        "6 8",
        "traceback.print_exception's file=None is sys.stderr, where the traceback goes",
    ),
    **mutants(
        "spes.failures.x_report",
        "48 51 52",
        "flushing the error line: Python's sys.stderr is line-buffered, and the line ends with its newline",
    ),
    **mutants(
        "spes.interrupt.x_still_read",
        "4",
        "the default of a stream never wrapped: None reads as False, a reader still there",
    ),
    **mutants(
        "spes.interrupt.xǁ_Unreadǁ__init__",
        "3",
        "a stream not yet found unread: None reads as False, as still_read takes it",
    ),
    **mutants(
        "spes.interrupt.xǁ_Unreadǁ_quietly",
        "9 12 13",
        "flushing the note: Python's sys.stderr is line-buffered, and the note ends with its newline",
    ),
    **mutants(
        "spes.failures.x__raised_at",
        "5 7",
        "the fallback frame: a caught exception's traceback holds the catching frame of spes.train, never a library's",
    ),
    **mutants(
        "spes.failures.x__raised_by_spes",
        "7",
        "an exception without a traceback: every failure reported was raised (and caught by spes.train's main)",
    ),
    **mutants(
        "spes.data.xǁTokenSequenceDatasetǁ__init__",
        "23",
        "how many threads open the shards (the pool's default instead of one per shard up to 16): the same shards",
    ),
    **mutants(
        "spes.shards.x__npy_layout",
        "12",
        "the header read again when the first bytes end exactly where it ends: one read more, the same bytes",
    ),
    **mutants(
        "spes.remote_ranges.x__total",
        "10",
        "the stand-in for an absent Content-Range: '' or 'XXXX', the pattern matches neither (the same refusal)",
    ),
    **mutants("spes.evaluators.x_lm_eval_scores", "17 21", _UTF8),
    **mutants("spes.evaluators.xǁDownstreamEvalsǁcheck_data", "41 43", _UTF8),
    **mutants("spes.evaluators.xǁDownstreamEvalsǁ_local_tasks", "41 46", _UTF8),
    **mutants(
        "spes.evaluators.xǁDownstreamEvalsǁcheck_data",
        "24",
        "a subprocess's cwd=None: it runs in this process's working directory, Path.cwd()",
    ),
    **mutants(
        "spes.evaluators.xǁDownstreamEvalsǁ_local_tasks",
        "29",
        "a subprocess's cwd=None: it runs in this process's working directory, Path.cwd()",
    ),
    **mutants(
        "spes.evaluators.x_lm_eval_scores",
        "26",
        "the metric split at the last comma: lm-eval's keys are `<metric>,<filter>`, one comma, so the same split",
    ),
    **mutants(
        "spes.corpus.x_record_text",
        "3 5 8 11",
        "the text of a malformed record: its callers read the text only when the reason is None",
    ),
    **mutants("spes.corpus.x_resolve_input_files", "13", _SETDEFAULT),
    **mutants("spes.corpus.xǁShardWriterǁwrite", "41", _SETDEFAULT),
    **mutants("spes.corpus.x__open_binary", "7", "gzip.open's default mode is 'rb'"),
    **mutants("spes.corpus.x__encode_all", "27", "ProcessPoolExecutor.shutdown's wait defaults to True"),
    **mutants("spes.corpus.x__tokenize", "75 78", "tqdm's file=None is sys.stderr, read when the bar is made"),
    **mutants(
        "spes.corpus.x__tokenize", "92", "set_postfix's refresh=None is falsy as False; the update after it draws"
    ),
    **mutants(
        "spes.corpus.x__tokenize",
        "36 37",
        "missing_ok of a leftover temp file the glob has just listed: nothing else removes it meanwhile (one run per "
        "prefix)",
    ),
    **mutants(
        "spes.corpus.x__checked_prefix",
        "6",
        "a prefix ending in the path separator: os.sep is '/' on the POSIX systems spes runs on, so the tuple's '/' "
        "and os.sep are one test",
    ),
    **mutants(
        "spes.corpus.xǁShardWriterǁ__init__",
        "34",
        "where the tokens end before any write(): a shard is flushed only once a write() buffered tokens, which sets "
        "it",
    ),
    **mutants(
        "spes.corpus.xǁShardWriterǁ_input_record",
        "7",
        "a sidecar with input settings but no position: tokenize_files gives the settings, and its chunks all carry "
        "their position",
    ),
    **mutants(
        "spes.corpus.x__skip",
        "2",
        "reading on at offset 0: read(0) reads nothing, which ends the loop as the test before it did",
    ),
    **mutants(
        "spes.corpus.x__tokenize",
        "93",
        "the bar redrawn at each chunk's postfix (refresh=None is False): the same lines, only drawn more often than "
        "tqdm's own clock draws them",
    ),
    **mutants("spes.corpus.x_tokenize_parser", "83 121", _NONE_DEFAULT),
    **mutants("spes.corpus.x_train_tokenizer_parser", "84", _NONE_DEFAULT),
    **mutants("spes.status.x_main", "28 35 45 55", _NONE_DEFAULT),
    **mutants(
        "spes.status.x_ask", "1", "`answered` None for False: both are false, and it is only read as a truth value"
    ),
    **mutants(
        "spes.status.x_ask",
        "36 39 43",
        "flushing the watch's unanswered line: sys.stderr is line-buffered, and the line ends with its newline",
    ),
    **mutants(
        "spes.status.x_main",
        "141",
        "the authorization header without a token (`Bearer None`): a server without a token reads no header, and "
        "one with a token refuses None as it refuses no header, with the same answer",
    ),
    **mutants(
        "spes.corpus.x__open_binary",
        "15 18 26",
        "zstandard's read_across_frames off: a read then stops at a frame's end and the next read goes on into the "
        "next frame, so the BufferedReader over it reads every frame all the same (tested on a file of two frames)",
    ),
    **mutants("spes.corpus.x__open_binary", "19", "stream_reader's closefd defaults to True"),
    **mutants("spes.corpus.x__iter_parquet_chunks", "58", "json_lines=None is falsy as False: the records are texts"),
    **mutants(
        "spes.corpus.x__iter_parquet_chunks",
        "29",
        "pyarrow's own batch size for the row groups read: the chunks are cut from the rows in order by `batch_size` "
        "whatever the batches",
    ),
    **mutants(
        "spes.corpus.x_file_texts",
        "3 5 8",
        "the encoding of a text file read whole: 'UTF-8' is 'utf-8', and Python reads files as UTF-8 under a UTF-8 "
        "locale (the C locale is coerced to one, PEP 538)",
    ),
    **mutants(
        "spes.corpus.x_file_texts",
        "17",
        "the records per chunk read: file_texts yields them one by one, whatever the chunks' size",
    ),
    **mutants("spes.corpus.xǁEncoderǁ__call__", "28", "np.fromiter's count: only a hint of the length it finds anyway"),
    **mutants(
        "spes.corpus.xǁEncoderǁ_encode",
        "1",
        "the batch encode failing every time: the one-by-one fallback gives the same ids, only slower",
    ),
    **mutants(
        "spes.corpus.x__init_worker",
        "5",
        "TOKENIZERS_PARALLELISM=FALSE: tokenizers reads the variable lower-cased",
    ),
    **mutants(
        "spes.corpus.x_tokenize_files",
        "3 4",
        "the library's default documents per unit of work and processes: the shards are the same for any (tested); "
        "only the CPU use differs",
    ),
    **mutants(
        "spes.corpus.x__encode_all",
        "26 28 30",
        "the futures still queued left to run when a run stops early: their chunks are dropped either way (those "
        "already handed to a worker run to their end anyway); only the time to stop differs",
    ),
    **mutants("spes.hf_convert.x__read_json", "3 5", _UTF8),
    **mutants("spes.hf_convert.x_copy_tokenizer", "44 46 56", _UTF8),
    **mutants("spes.hf_convert.x_write_safetensors", "74 76 86", _UTF8),
    **mutants(
        "spes.hf_convert.x__layered",
        "2",
        "a key without a layer index taken once per layer: the same tensor under the same name each time",
    ),
    **mutants(
        "spes.hf_map.x_check_hf_config",
        "19 20",
        "the rope_type of the stand-in for a config without rope_parameters: read with the default 'default' anyway",
    ),
    **mutants("spes.hf.x__parser", "7", "the help formatter of a one-line description: nothing to re-wrap"),
    **mutants("spes.hf_map.x_model_config_from_hf", "26", "bool(None) is bool(False)"),
    **mutants(
        "spes.hf_convert.x_read_hf_config",
        "40 42 44",
        "local_files_only for a local directory: transformers reads its config.json there, never the network",
    ),
    **mutants("spes.hf_convert.x_run_config_for", "27", "TokenizerConfig() is the field's default"),
    **mutants("spes.hf_convert.x_write_safetensors", "27", "tensor.to(None) is the tensor: nothing to convert"),
    **mutants("spes.hf_map.xǁHFFamilyǁconfig_attr", "22", "no key: neither '' nor 'XXXX' is an attribute's name"),
    **mutants(
        "spes.upcycling.x_make_random_dense",
        "35 42",
        "the demo model's fixed options and BOS id as the config class has them already (SiLU, no biases; Qwen3 "
        "sets no BOS, and nothing of spes reads a BOS id)",
    ),
    **mutants(
        "spes.upcycling.x_check_dense_tokenizer",
        "3",
        "the tokenizer check's embedding size: ModelConfig refuses embedding_size < vocab_size itself",
    ),
    **mutants(
        "spes.remote_files.x__copy",
        "17 20 25",
        "flush or not: stderr is line-buffered (Python 3.9+), so each progress line is written out at its newline",
    ),
    **mutants(
        "spes.remote_files.x__download",
        "46 49 54",
        "flush or not: stderr is line-buffered (Python 3.9+), so the line is written out at its newline",
    ),
    **mutants(
        "spes.remote_files.x__fetch_into",
        "13 14 25 26",
        "a header's case: urllib's Request capitalizes the names it sends, and a response's headers are looked up "
        "without case",
    ),
    **mutants(
        "spes.remote_files.xǁ_NoSpaceǁ__init__",
        "1 2 3 4",
        "the exception's args: it is caught inside the module, which words its message from its fields",
    ),
    **mutants(
        "spes.tracking.x__quiet_writer_threads",
        "4",
        "getattr's default None for False: a hook without the flag is taken for not spes's either way (only its truth "
        "is read)",
    ),
    **mutants(
        "spes.tracking.x_olmo_aliases",
        "38",
        "the divisor of a layer whose experts got no token: every share is 0 whatever it is",
    ),
    **mutants(
        "spes.speed.x_step_figures",
        "24 30 65 71 76 89",
        "1e12 + 1 for 1e12 (TFLOP): one part in a trillion, below every figure's precision",
    ),
    **mutants(
        "spes.speed.x_random_batch",
        "8",
        "randint(high, size) is randint(0, high, size): the same draws, same generator",
    ),
    **mutants(
        "spes.speed.x__spes_caller",
        "3",
        "starting a frame further up: the frame it skips is the counter's own, which the walk passes by file anyway",
    ),
    **mutants(
        "spes.speed.x_build_timed_node",
        "37 43 48",
        "the timed node's log: `train_step` logs only a skipped non-finite step, and timed steps are finite",
    ),
    **mutants(
        "spes.guard.x_first_nonfinite_parameter",
        "2 4",
        "the shard check without `.to_local()`: torch's DTensor answers isfinite(...).all() of a sharded parameter "
        "from the local shard too (checked: tests/test_guard.py::test_every_rank_agrees_on_one_ranks_nan[gloo] "
        "passes with it); .to_local() says so",
    ),
    **mutants(
        "spes.optim.x_lr_at",
        "18",
        "`max(t_warmup, 2)`: it differs from max(t_warmup, 1) only for t_warmup <= 1, where the one step the warm-up "
        "line serves (step < t_warmup) is step 0 of t_warmup 1, whose numerator (peak - start) * 0 is 0 whatever the "
        "divisor; no step is negative (the trainer asks from step 1 on, a re-warm-up for its end and the steps after)",
    ),
    **mutants(
        "spes.sync.codecs.int8.x_dequantize",
        "4 7",
        "the output's dtype left to torch's default, float32: the one asked for",
    ),
    **mutants(
        "spes.sync.codecs.int8.x_quantize",
        "17 20",
        "the scales' dtype left to torch's default, float32: the one asked for",
    ),
    **mutants(
        "spes.sync.codecs.int8.x_dequantize",
        "5 8",
        "the output made on the default device, the CPU: every payload spes decodes is CPU bytes off the wire",
    ),
    **mutants(
        "spes.sync.codecs.int8.x_quantize",
        "11 14 18 21",
        "the payload made on the default device, the CPU: every delta spes quantizes is on the CPU (gather_full's "
        "copies on a node, the server's global model)",
    ),
    **mutants(
        "spes.sync.codecs.int8.x_quantize",
        "84",
        "`scale >= 0`: a zero block's 0 / 0 is NaN, which torch casts to int8 as 0 (x86-64, aarch64): the same "
        "values; the guard keeps that 0 from being a platform's accident",
    ),
    **mutants(
        "spes.sync.codecs.int8.x_quantize",
        "88",
        "`.to(None)` keeps the rounded floats, which the assignment into the int8 values casts exactly",
    ),
    **mutants(
        "spes.sync.codecs.int8.x_quantize",
        "89 90 92",
        "one bound of the clamp dropped: |x| / fl(absmax / 127) is at most 127 (1 + 2^-23)^2 < 127.5 in fp32, so "
        "the rounded quotient never passes +-127 and neither bound ever binds",
    ),
    **mutants(
        "spes.sync.codecs.int8.xǁInt8Payloadǁpack",
        "4 5 6",
        "the message of a big-endian host's refusal: unreachable on the little-endian hosts spes runs and is tested on",
    ),
    **mutants(
        "spes.sync.codecs.sparse.x_pack_bits",
        "19",
        "the entries left int64 instead of int32: shifted and masked, the same bits in the same bytes",
    ),
    **mutants(
        "spes.sync.codecs.sparse.x_unpack_bits",
        "49",
        "a group's first byte OR-ed into its word a second time (at shift 0): x | x == x",
    ),
    **mutants(
        "spes.sync.codecs.sparse.x__by_rows",
        "27",
        "a pool of Python's default size instead of `threads` workers: the rows are still cut into `threads` blocks, "
        "so as many run at once, each row's result the same",
    ),
    **mutants(
        "spes.sync.codecs.sparse.x__increasing",
        "9",
        "numpy's default axis is the last, axis 1 of the 2-D rows",
    ),
    **mutants(
        "spes.sync.codecs.sparse.x__top",
        "15",
        "numpy's default axis is the last, axis 1 of the 2-D rows",
    ),
    **mutants(
        "spes.sync.codecs.sparse.x_largest",
        "10",
        "max(1, ...) differs from max(0, ...) only where length // k <= 1: a row under 16 k, which takes one "
        "selection and never uses g",
    ),
    **mutants(
        "spes.sync.codecs.sparse.xǁSparsePayloadǁper_entry",
        "14",
        "the concatenation made for a payload whose chunks are all whole too: the body and nothing, the body itself",
    ),
    **mutants(
        "spes.sync.codecs.sparse.xǁSparsePayloadǁpack",
        "4 5 6",
        "the message of a big-endian host's refusal: unreachable on the little-endian hosts spes runs and is tested on",
    ),
    **mutants(
        "spes.sync.codecs.sparse.x__scale_and_levels",
        "29 30 32",
        "one bound of the clamp dropped: |x| <= s, so the correctly rounded x / s is in [-1, 1] and "
        "(x / s * top + top) / 2 in [0, top]: neither bound ever binds",
    ),
    **mutants(
        "spes.sync.codecs.sparse.x__values",
        "8 15",
        "the small int64 level numbers times the fp32 scale promote to fp32 exactly without the cast",
    ),
    **mutants(
        "spes.sync.codecs.sparse.x_dequantize",
        "5 7",
        "the output's dtype left to torch's default, float32: the one asked for",
    ),
    **mutants(
        "spes.sync.codecs.held.xǁHeldPeerǁ__init__",
        "7",
        "a fresh peer's spare tensors None instead of none: they are read only to apply a delta, which needs a held "
        "model, and `receive` and `load_state_dict`, which give one, set them first",
    ),
    **mutants(
        "spes.sync.codecs.held.xǁHeldPeerǁreceive",
        "23",
        "a restarted server's full values of a round the peer took part in held as its old held model with what the "
        "round served and its own reconstructions instead of whole: the same tensors (the round changed no others), "
        "what the restart tests compare round after round",
    ),
    **mutants(
        "spes.sync.codecs.held.x__add",
        "19",
        "a dense delta left where it is: `_add` gets one only from `encode_delta`, which subtracts it from the target "
        "it was encoded from, on that target's device (every quantizer's payload and delta stay on its input's)",
    ),
    **mutants(
        "spes.sync.codecs.held.x_changed",
        "1 6",
        "the server's check of what a delta changed: every entry instead of the sent ones (a finite base, as every "
        "published round is, gives the same verdict, at more cost), or its positions left where they are (the "
        "server's models and the payloads it decodes are all on the CPU)",
    ),
    **mutants(
        "spes.sync.codecs.held.x_apply_finite",
        "15",
        "every entry checked instead of the delta's: the base is finite (a round is published only so, and a node "
        "holds only finite downloads), so the same verdict, at more cost",
    ),
    **mutants(
        "spes.sync.codecs.held.xǁHeldServerǁselect",
        "7 14 15 18 23 24",
        "another key of one kind of download: the key only tells a round's shared encoded forms apart (a dict key, "
        "never sent), and the two kinds' keys stay distinct",
    ),
    **mutants(
        "spes.sync.fragments.x_split_fragments",
        "32",
        "every fragment's load starting at 1 instead of 0: the same constant added to all, so the lightest is the same",
    ),
    **mutants(
        "spes.sync.fragments.xǁLayoutǁof",
        "18 25",
        "split_fragments called for one fragment too: it returns (tuple(manifest),), what the other branch builds",
    ),
    **mutants(
        "spes.sync.overlap.x_apply_overlapped",
        "12",
        "`same_dtype=None`: read only as a truth value, like False",
    ),
    **mutants(
        "spes.sync.overlap.x_apply_overlapped",
        "29",
        "a global tensor cloned even when widening made it a new tensor: the same values, one copy more",
    ),
    **mutants(
        "spes.sync.overlap.x_apply_overlapped",
        "22 24 51 56",
        "a tensor left on its device instead of moved to the parameter's: the trained tensors and their snapshot are "
        "gather_full's CPU copies, the global model comes off the wire on the CPU, and load_full moves each result "
        "to its parameter's device (a frozen one may be on the GPU): the same values are loaded",
    ),
    **mutants(
        "spes.sync.overlap.xǁPendingRoundǁsave",
        "11",
        "`.to(None)` leaves a snapshot where it is: a snapshot is gather_full's CPU copies",
    ),
    **mutants(
        "spes.sync.merge.x__add_widened",
        "10 12",
        "the scratch buffer's dtype left to torch's default, fp32: `total`'s (a mean is always summed in fp32)",
    ),
    **mutants(
        "spes.sync.merge.x__merge_layer",
        "22 25 36 39 42 48",
        "zip without strict=True: the zipped sequences have equal lengths by construction (the three kinds and "
        "merge_experts's three results; the blocks and their split by sizes)",
    ),
    **mutants(
        "spes.sync.merge.x_build_global",
        "16 17",
        "the message of `assert per_block is not None`: an internal invariant (the coordinator builds rounds over a "
        "complete run spec only), so no test can reach the message",
    ),
    **mutants(
        "spes.sync.merge.x_mean_over_peers",
        "18",
        "fp32 tensors added through the widening scratch buffer and bf16 ones by torch's mixed-dtype add: both add "
        "exactly, only the speed differs",
    ),
    **mutants(
        "spes.sync.merge.x_merge_experts",
        "66",
        "torch.sort without dim=1 sorts along the last dimension, dim 1 of the 2-D similarity matrix",
    ),
    **mutants(
        "spes.sync.rounds.xǁRoundStateǁ__init__",
        "7 8 9 10 15 19",
        "the state of the round before any opens: stage_upload sets opened_at, the stalls counted at its opening and "
        "fragment when one opens, and nothing reads them before; aggregating=None reads as False",
    ),
    **mutants(
        "spes.sync.rounds.xǁRoundStateǁ_admit_open",
        "21",
        "`step <= open_round`: every branch above has already answered step == open_round",
    ),
    **mutants(
        "spes.sync.rounds.xǁRoundStateǁadmit",
        "38 40",
        "the default of a committed peer's digest: a peer in `uploaded` always has one (stage_upload records both)",
    ),
    **mutants(
        "spes.sync.rounds.xǁRoundStateǁcheck_download",
        "15",
        "`step <= latest`: step == latest has already returned True",
    ),
    **mutants(
        "spes.sync.rounds.xǁRoundStateǁseconds_left",
        "5",
        "float('INF'): Python reads it as float('inf')",
    ),
    **mutants(
        "spes.sync.wire.xǁVerifiedChecksumsǁknown",
        "7 8 9 10",
        "the fallback record of a name never recorded: its reference is None, so it is never used whatever its "
        "version, dtype or checksum",
    ),
    **mutants(
        "spes.sync.wire.x__rechunk",
        "4",
        "a piece of exactly chunk_bytes with nothing pending goes through the copying branch: the same chunk",
    ),
    **mutants(
        "spes.sync.wire.x_encode_tensor",
        "5",
        "the same chunks: a raw tensor encoded whole before chunking (the two passes only spare a second copy)",
    ),
    **mutants(
        "spes.sync.wire.x_encode_tensor",
        "61 62 65 66",
        "an empty tensor's chunk without offset 0 or data b'': proto3 fields default to exactly those",
    ),
    **mutants(
        "spes.sync.wire.x_encode_tensors",
        "5 10 12",
        "the precomputed forms ignored: encode_tensor computes the very same bytes and checksums (they only save "
        "the work)",
    ),
    **mutants(
        "spes.sync.wire.x_finite",
        "1 4",
        "the fast path (a finite sum) skipped: the exact min/max check gives the same answer, slower",
    ),
    **mutants(
        "spes.sync.wire.xǁTensorDecoderǁ__init__",
        "6 10 11 17 19 20 22 23 24 26",
        "the state of the tensor being received before any: `_start` sets every field at each header, and "
        "nothing reads them before one (a headless chunk is refused first)",
    ),
    **mutants(
        "spes.sync.wire.xǁTensorDecoderǁ_finish_current",
        "30 32",
        "the state reset after a tensor: `_start` sets it again at the next header before anything reads it",
    ),
    **mutants(
        "spes.sync.wire.xǁTensorDecoderǁ_check_finite",
        "4",
        "`... or self._params is not None and end == self._checked`: a raw tensor then checks an empty slice "
        "(finite), a coded payload its uint8 bytes (always finite): the same answers",
    ),
    **mutants(
        "spes.moe.x_init_truncated_normal_",
        "6 15",
        "the mean argument dropped: torch's normal_ and trunc_normal_ default to a mean of 0.0, the one asked for",
    ),
    **mutants("spes.moe.x_fuse_expert_blocks", "24", "torch.cat's dim left to its default, 0: the one given"),
    **mutants("spes.moe.x_split_expert_blocks", "15", "torch.split's dim left to its default, 0: the one given"),
    **mutants(
        "spes.moe.xǁExpertBlocksǁ_block_forward",
        "21 23",
        "the group sizes' dtype left to torch's: a tensor of Python ints is int64, the one asked for",
    ),
    **mutants(
        "spes.moe.x_decayed_lb_factor",
        "14",
        "a ramp of at least 1.000000000001 steps for 1e-12: they differ only when 0.2 * max_steps < 1, where any "
        "refresh step (>= update_steps >= 1) is past either ramp, so the factor is 1.0 both ways",
    ),
    **mutants("spes.moe.x_router_z_loss", "6", "dim 1 for -1 of the 2-D (tokens, experts) logits: the same dim"),
    **mutants(
        "spes.moe.xǁMoEǁforward",
        "15 21 22 33 79",
        "dim 1 (or topk's default, the last) for -1 of 2-D (tokens, experts) routing tensors, unsqueeze(1) for (-1) "
        "of a 1-D one: the same dims",
    ),
    **mutants(
        "spes.moe.xǁMoEǁforward",
        "57 62",
        "an argsort that may reorder equal keys: equal keys are copies routed to one expert, each a different token "
        "computed on its own row and added back to its own token; a token's copies have different keys",
    ),
    **mutants("spes.moe.xǁMoEǁ__init__", "8", "bias=None for bias=False: nn.Linear tests it for truth"),
    **mutants(
        "spes.moe.xǁExpertBlocksǁ_touch",
        "3 5 7 9",
        "an empty (0, D) product: its value and every gradient through it are zero (or empty) whatever it "
        "divides or casts",
    ),
    **mutants(
        "spes.moe.xǁExpertBlocksǁforward",
        "22",
        "the empty product `_touch` also made under no_grad: concatenated, an empty tensor changes nothing",
    ),
    **mutants(
        "spes.moe.xǁExpertBlocksǁ_grouped",
        "29 31",
        "the trained blocks concatenated even when there is one: a copy, with the same values and the same gradient "
        "back to the one parameter",
    ),
    **mutants(
        "spes.moe.xǁ_TrainedFirstGroupedMMǁforward",
        "3",
        "the trained weight concatenated with no frozen block: a copy, the same values",
    ),
    **mutants(
        "spes.moe.xǁ_TrainedFirstGroupedMMǁbackward",
        "5 20 21",
        "the input's gradient computed when nobody wants it (autograd drops it), or keyed on the weight's need, or an "
        "empty string for the weight's: the function is applied only with a trained weight that needs its gradient "
        "and hidden states that need theirs (`_grouped`), so these branches are never taken",
    ),
    **mutants(
        "spes.moe.x_resolve_backend",
        "8 9 10 11",
        "the capability of the current CUDA device, or a threshold above 8.0: spes makes each process's one GPU the "
        "current device, and on the Hopper GPU (9.0) the GPU tests run on every threshold answers alike (Ampere "
        "would take the loop: slower, the same values)",
    ),
    **mutants(
        "spes.data.x_repetitive_instances",
        "47",
        "`/` for `//` before comparing with the integer max_count: x >= m exactly when floor(x) >= m",
    ),
    **mutants(
        "spes.data.xǁBatchLoaderǁ_rank_indices",
        "11 18",
        "a full batch padded with nothing, or a short one padded past the global batch: the rank slices take rows "
        "below the global batch size only",
    ),
    **mutants(
        "spes.data.xǁBatchLoaderǁ_start_batches",
        "1 2",
        "which of the two paths serves 0 (or 1) workers: DataLoader in-process and the generator yield the same "
        "batches in the same order (test_worker_processes_yield_the_same_batches)",
    ),
    **mutants(
        "spes.data.xǁBatchLoaderǁ_worker_batches",
        "11",
        "DataLoader's num_workers left at its default, 0, when asked for workers: the same batches in the same "
        "order, made in this process",
    ),
    **mutants(
        "spes.data.xǁBatchLoaderǁ_worker_batches",
        "8 12",
        "the workers' batches left unpinned: the trainer pins an unpinned batch itself before its copy to the GPU "
        "(Trainer._to_device); only where the pinning happens differs",
    ),
    **mutants(
        "spes.data.xǁBatchLoaderǁ_maybe_pin",
        "1",
        "batches left unpinned: the trainer pins an unpinned batch itself before its copy to the GPU "
        "(Trainer._to_device); only where the pinning happens differs",
    ),
    **mutants(
        "spes.sync.aggregate.x_build_round",
        "28 37",
        "build_global's names left to its default, the uploaded names sorted: an upload holds exactly the round's "
        "fragment's names (the server decodes no other), and the global model is put in the manifest's order after",
    ),
    **mutants(
        "spes.objective.x_language_model_loss",
        "4 14",
        "`logit_z` None or True for False: the z-loss sum is then not computed, or computed and dropped; "
        "language_model_loss returns the cross entropy alone either way",
    ),
    **mutants(
        "spes.objective.x_loss_sums",
        "10",
        "an assertion weakened (`or` for `and`): given the labels, the model returns both sums or raises first",
    ),
    **mutants(
        "spes.head_loss.x__gemm_accumulates_fp32",
        "7",
        "the capability of the current CUDA device for the output's: spes makes each process's one GPU the current "
        "device (spes.distributed.init_distributed), so they are the same device",
    ),
    **mutants(
        "spes.head_loss.x__gemm_accumulates_fp32",
        "8 9 10",
        "the capability threshold moved above 8.0: Ampere GPUs would take the other path, which adds the same "
        "product (rounded to bf16 first); the GPU tests run on Hopper (9.0), where every threshold answers alike",
    ),
    **mutants(
        "spes.head_loss.x_chunk_loss_grads",
        "14",
        "logsumexp over dim 1 for dim -1: a chunk's logits are 2-D (tokens, vocabulary), so they are the same dim",
    ),
    **mutants(
        "spes.head_loss.x_logit_loss_sums",
        "20",
        "logsumexp over dim 1 for dim -1: the logits are 2-D (tokens, vocabulary), so they are the same dim",
    ),
    **mutants(
        "spes.head_loss.x_logit_loss_sums",
        "9",
        "cross_entropy without ignore_index=IGNORE_INDEX: torch's default ignore_index is -100, IGNORE_INDEX",
    ),
    **mutants(
        "spes.head_loss.x_head_loss_sums",
        "18 20",
        "the sums' accumulators started in the hidden states' dtype: the first chunk's fp32 0-dim sums promote them "
        "to fp32 (0-dim tensors of one kind promote to the wider dtype)",
    ),
    **mutants(
        "spes.head_loss.xǁ_HeadLossǁforward",
        "18 20",
        "the sums' accumulators started in the hidden states' dtype: the first chunk's fp32 0-dim sums promote them "
        "to fp32 (0-dim tensors of one kind promote to the wider dtype)",
    ),
    **mutants(
        "spes.head_loss.xǁ_HeadLossǁforward",
        "63",
        "no cast of the weight's gradient to the weight's dtype in backward: autograd casts a gradient to its "
        "input's dtype itself (the cast only frees the fp32 buffer sooner)",
    ),
    **mutants(
        "spes.head_loss.xǁ_HeadLossǁbackward",
        "11",
        "no cast of the weight's gradient to the weight's dtype: autograd casts a gradient to its input's dtype "
        "itself (the cast only frees the fp32 buffer sooner)",
    ),
    **mutants(
        "spes.sync.auth.x__deny_like",
        "5 6 7",
        "the message of the AssertionError after context.abort, which raises: the line never runs",
    ),
    **mutants(
        "spes.sync.auth.x_check_peer_identity",
        "4",
        "`common_name or 'XXXX'`: no name matches peer-<id> either way, so a call without a certificate is refused",
    ),
    **mutants(
        "spes.sync.auth.x_tls_common_name",
        "5 9 10",
        "the type named to typing.cast, which returns its value unchanged at run time",
    ),
    **mutants(
        "spes.sync.auth.xǁTokenAuthInterceptorǁintercept_service",
        "11 13 16",
        "the value of a missing authorization header: None is not a str and 'XXXX' is not 'Bearer <token>', so "
        "token_matches refuses the call as it refuses ''",
    ),
    **mutants(
        "spes.sync.channel.x_server_tls",
        "11",
        "`cert is None and key is None`: the line above refuses one without the other, so both are given or neither",
    ),
    **mutants(
        "spes.sync.channel.x_client_tls",
        "28",
        "`cert is not None or key is not None`: the line above refuses one without the other, so both are given or "
        "neither",
    ),
    **mutants(
        "spes.sync.channel.x_probe_handshake",
        "18",
        "recv(2) for recv(1): either returns the first bytes the server sends, or b'' only when it hung up",
    ),
    **mutants(
        "spes.sync.admission.xǁPendingSlotsǁ__init__",
        "8",
        "`total / 4`: the per-address bound a float of the same value, compared with whole counts alike",
    ),
    **mutants(
        "spes.sync.admission.xǁSessionsǁpresent",
        "15",
        "a new session's last_seen left None: the same call sets it (the session is its own, so it is counted)",
    ),
    **mutants(
        "spes.sync.admission.xǁStreamGuardǁ_watch",
        "6 7 8",
        "the watchdog's polling period: how soon past its limit a stream ends (a quarter of the idle timeout, 0.5 s "
        "at most), not whether; no test times it",
    ),
    **mutants(
        "spes.sync.admission.xǁStreamGuardǁstop",
        "1 2",
        "how long stop() waits for the watchdog, which ends within one polling period (0.5 s at most)",
    ),
    **mutants(
        "spes.sync.admission.xǁTicketǁ__init__",
        "4 6",
        "None for False as a new ticket's waiting and expired flags: both are only ever tested for truth",
    ),
    **mutants(
        "spes.sync.admission.xǁTicketǁtoo_slow",
        "15 16",
        "the first bound of the rate check: while now - started <= idle_timeout_s the floor min_rate x (now - "
        "started - idle_timeout_s) is not positive, so no byte count is under it; the bound only spares the product",
    ),
    **mutants(
        "spes.sync.admission.xǁGuardedHealthǁ__init__",
        "1",
        "experimental_non_blocking=None: grpcio's health servicer tests it for truth, as False",
    ),
    **mutants(
        "spes.sync.buffers.xǁBufferPoolǁset_limits",
        "4 6",
        "`get(key, None)` for `get(key, 0)`: free[None:] and free[0:] are both the whole list, deleted alike",
    ),
    **mutants(
        "spes.atomic.x_umask_mode",
        "3",
        "the umask set for the moment between reading and restoring it (0o023 for 0o022): the one read is put back",
    ),
    **mutants(
        "spes.atomic.x_publish_dir",
        "10",
        "the file opened for reading as text instead of bytes: fsync takes its descriptor either way",
    ),
    **mutants(
        "spes.atomic.x_write_atomic",
        "39",
        "the temporary file opened read-only instead of for update: fsync takes its descriptor either way",
    ),
    **mutants(
        "spes.atomic.x_publish_dir",
        "25 27 28",
        "an error deleting the moved-aside old copy raised rather than ignored: only once the new copy is in place, "
        "and no deletion fails in the tests (they run as root)",
    ),
    **mutants(
        "spes.sync.state.x_save_round",
        "63 65 66",
        "state.json's indentation: the same JSON for json.loads",
    ),
    **mutants(
        "spes.sync.state.x_save_round",
        "75 76",
        "unlinking a stale round file listed a moment before without missing_ok: only another process removing it "
        "in between would tell",
    ),
    **mutants(
        "spes.sync.state.x_spec_record",
        "1",
        "the spec's tuples left tuples: json.dumps writes them as lists",
    ),
    **mutants("spes.checkpoint.x_model_state_dict", "2 6 7 8", "the type named to typing.cast: no run-time effect"),
    **mutants("spes.checkpoint.x__optim_state_dict", "2 6 7 8", "the type named to typing.cast: no run-time effect"),
    **mutants(
        "spes.save_folder.x_prune",
        "21",
        "`keep >= 0`: with keep 0, own[-0:] is the whole list, as the branch for keep <= 0 keeps it",
    ),
    **mutants(
        "spes.save_folder.x_prune",
        "25 27 28",
        "an error deleting a pruned old checkpoint raised rather than ignored: no deletion fails in the tests (root)",
    ),
    **mutants(
        "spes.save_folder.x_remove_stale_temporaries",
        "25 27 28 29 30",
        "an error deleting a killed save's leftover raised rather than ignored: no deletion fails in the tests (root), "
        "and one process writes a save folder at a time",
    ),
    **mutants("spes.checkpoint.x__write_meta", "25 27 28", "meta.json's indentation: the same JSON for json.loads"),
    **mutants(
        "spes.checkpoint.x__flatten_optim",
        "5 6 7",
        "AdamW's state holds tensors only (its step included): the branch for other values is never taken",
    ),
    **mutants(
        "spes.checkpoint.x__flatten_optim",
        "9",
        "param groups' tuples left tuples: json.dumps writes them as lists",
    ),
    **mutants(
        "spes.checkpoint.x__unflatten_optim",
        "4",
        "how a flat optimizer key is split: a parameter's name is dotted and holds no '/', so '<name>/<key>' splits "
        "at its one '/' every way",
    ),
    **mutants(
        "spes.sync.node_files.x_save_codec_state",
        "2",
        "the codec state's tensors moved to the CPU before saving: safetensors' save_file moves a tensor on another "
        "device to the CPU itself, so the file is the same",
    ),
    **mutants(
        "spes.checkpoint.x__is_meta",
        "15",
        "a file named '.' in meta.json: `name == Path(name).name` refuses it already (Path('.').name is '')",
    ),
    **mutants(
        "spes.checkpoint.x__restore_sliced",
        "13 14 16",
        "how a flat optimizer key is split: a parameter's name is dotted and holds no '/', so '<name>/<key>' splits "
        "at its one '/' every way",
    ),
    **mutants(
        "spes.sync.admission.xǁGuardedHealthǁWatch",
        "12",
        "the context a watch's ticket would cancel: a watch waits on the server (wait_for_round(True)) and has no "
        "deadline, so the watchdog never ends it",
    ),
    **mutants(
        "spes.sync.admission.xǁGuardedHealthǁWatch",
        "50 53",
        "the send callback passed on: the service runs in blocking mode, where grpcio calls Watch without one, so "
        "it is None either way",
    ),
    **mutants(
        "spes.atomic.x_publish_dir",
        "5 6",
        "which files are fsynced before the rename: durability across a power cut, which no test can observe",
    ),
    **mutants(
        "spes.sync.buffers.x_round_limits",
        "8",
        "trainable(None) is the shared tensors alone, which are all that `averaged` keeps of any peer's list",
    ),
    **mutants(
        "spes.config.x__f",
        " ".join(map(str, range(1, 26))),
        "called only while spes.config is imported (the dataclasses' fields), before mutmut's child switches a mutant "
        "on, so no test sees one; the defaults, docs and ranges it makes are checked by the shipped configs', "
        "test_every_key_has_a_doc's and the BOUNDS tests",
    ),
    **mutants(
        "spes.config.x__sub",
        "1 2 3 4 5 6",
        "called only while spes.config is imported (the dataclasses' sections), as `_f`: no test sees a mutant; "
        "the sections and their docs are checked by test_help_lists_every_section_and_key_with_its_doc",
    ),
    **mutants(
        "spes.schema.x_config_help",
        "11 13 16 40 42 45",
        "the text shown for a field without a doc: every field has one (test_every_key_has_a_doc)",
    ),
    **mutants(
        "spes.schema.x__merge_overrides",
        "12",
        "the defaults of no class on the failure path: overrides that cannot merge into the file meet a list where a "
        "mapping goes or back, which the defaults of any class cannot merge with either, so the resolution takes its "
        "fallback all the same",
    ),
    **mutants(
        "spes.schema.x__resolve_against_defaults",
        "3 5 20 22",
        "resolve=None or left out: OmegaConf's default is False, which is what the shape of the user's keys (and "
        "the values as written) reads",
    ),
    **mutants(
        "spes.schema.x_from_dict",
        "9",
        "str.rstrip takes a set of characters: 'XX.XX' strips the same '.' ending a prefix, and no section ends in X",
    ),
    **mutants(
        "spes.schema.x__load_mapping",
        "7",
        "'' for None as what OmegaConf refused: neither is a mapping or a list, so both are 'a single value'",
    ),
    **mutants(
        "spes.sync.joins.x_check_manifest", "6 7", "the message of an assertion that holds (a peer's spec is complete)"
    ),
    **mutants(
        "spes.sync.coordinator.xǁCoordinatorǁ__init__",
        "20",
        "the shutdown flag's first value None for False: every reader tests its truth (`if`, the status reporter's "
        "`wait_for` predicate, the callers of `stopping` and of the downloads' `stopping` callback)",
    ),
    **mutants(
        "spes.sync.coordinator.xǁCoordinatorǁ__init__",
        "22",
        "the advertised data port None for 0 until a data plane starts: a JoinReply field given None is left unset, "
        "which reads 0 (no data plane) as 0 does, and it is read nowhere else (start_server sets it before serving)",
    ),
    **mutants(
        "spes.config.xǁModelConfigǁ__post_init__",
        "53",
        "`/` for `//` in the RoPE check: the check before it has made d_model a multiple of n_heads, so both are the "
        "same whole number",
    ),
    **mutants(
        "spes.model.x_analytic_param_counts",
        "1",
        "an assertion for the type checker: ModelConfig.__post_init__ sets both embedding_size and n_kv_heads",
    ),
    **mutants(
        "spes.model.x_count_params",
        "14",
        "`/` for `//`: the experts' parameters are L x E x 3 d f, a multiple of E, so the active count is the same "
        "whole number (a float equal to the int)",
    ),
    **mutants(
        "spes.model.x_rope_tables",
        "9 14 24 27",
        "the positions or frequency exponents drawn as int64: the division by head_dim and the outer product with "
        "float32 promote to float32, and the integers are exact",
    ),
    **mutants(
        "spes.model.x_rope_tables",
        "10 15 25 28",
        "the tables computed on the default device: init_weights copies them into the buffers wherever those are "
        "(on the CPU the same values; on a GPU they may differ in the last bit, which no test pins)",
    ),
    **mutants("spes.model.x_rope_tables", "34", "dim=+1 of the 2-D (S, Hd / 2) angles is dim=-1"),
    **mutants(
        "spes.model.x_assign_whole",
        "9",
        "distribute_tensor's default src_data_rank=0 scatters rank 0's whole tensor instead of each rank keeping its "
        "shard of its own: the same values (every rank draws the same tensor from the same seed), one collective more",
    ),
    **mutants(
        "spes.model.xǁTransformerǁ__init__",
        "48 57",
        "persistent=None: register_buffer leaves a buffer out of the state dict when persistent is falsy",
    ),
    **mutants(
        "spes.model.xǁAttentionǁ__init__",
        "8 17 26 35",
        "bias=None: nn.Linear makes a bias only when bias is truthy",
    ),
    **mutants("spes.model.xǁTransformerǁ__init__", "33", "bias=None: nn.Linear makes a bias only when bias is truthy"),
    **mutants(
        "spes.model.xǁAttentionǁ__init__",
        "42 43",
        "'' for None as a QK-norm that is not there: forward applies the norms only when both are not None, and "
        "without attention_layer_norm the other one is None",
    ),
    **mutants(
        "spes.model.xǁTransformerǁforward",
        "1 6",
        "shape[+1] of the (B, S) token ids is shape[-1]",
    ),
    **mutants(
        "spes.model.xǁTransformerǁforward",
        "14 16",
        "the aux sums started in the embedding's dtype, which is float32 in every precision spes runs (amp keeps "
        "parameters in fp32)",
    ),
    **mutants(
        "spes.sync.uploads.xǁUploadsǁ_decode",
        "28 30",
        "the peer's own blocks of the whole manifest for those of the upload's fragment: the codec consults that "
        "set only for tensors the upload carries",
    ),
    **mutants(
        "spes.sync.uploads.xǁUploadsǁreceive",
        "1",
        "the digest of an in-process caller that gives none (both planes always do): any constant names the same "
        "content for every such call",
    ),
    **mutants(
        "spes.sync.uploads.xǁUploadsǁreceive", "94", "duplicate=None leaves the protobuf bool unset, which reads False"
    ),
    **mutants(
        "spes.schema.x__unknown_key_message",
        "8 9 10",
        "the best match is close[0] whatever n, and 0.6 is difflib's default cutoff",
    ),
    **mutants(
        "spes.schema.x__coerce",
        "11",
        "a union member's key and place are named only in the errors the union swallows before naming its own",
    ),
    **mutants(
        "spes.schema.x__lookup_field",
        "45",
        "every dict-typed key is a plain `dict`, which the hint itself matches: its origin is never consulted",
    ),
    **mutants(
        "spes.schema.x__checked_override",
        "30",
        "an interpolation quoted: YAML reads `${...}` bare or single-quoted as the same text, which OmegaConf resolves "
        "all the same (a text key's value is a string either way)",
    ),
    **mutants(
        "spes.config.x_load_sync_sections",
        "7 10",
        "the part before the first '=' is the same whatever the split's limit",
    ),
    **mutants(
        "spes.config.x_load_sync_sections",
        "30 34 35 42 43 44 45 54 63 64",
        "from_dict here reads only keys and values `checked_overrides` has already checked, and a prefix is named "
        "only in unknown-key and type errors; the place, in the checks of the section itself, which SpesConfig "
        "does not have (ServerSection's are named by test_config)",
    ),
    **mutants(
        "spes.config.x_load_sync_sections",
        "74 76",
        "using_dilico's default when the command line leaves it out: None reads as False wherever it is read (the "
        "mode, check_mode's `or not using_dilico`)",
    ),
    **mutants(
        "spes.node.x__validation",
        "33 34",
        "the validation limit's comparison with 0 or 1: the config refuses eval_subset_num_batches 0 (-1 for all, or "
        ">= 1), and the three agree on every other value",
    ),
    **mutants(
        "spes.node.x__training_loader",
        "10",
        "check_vocab without the embedding size: the config fills embedding_size with vocab_size and refuses it "
        "smaller, so the embedding check it feeds never fires",
    ),
    **mutants(
        "spes.node.x_check_save_folder",
        "6 29",
        "the return value of the check's silent log function: nothing reads it",
    ),
    **mutants(
        "spes.node.x_check_save_folder",
        "17 24 26 27 28",
        "the check claims the folder as a dry run of a rank that is not the main one: either alone removes nothing, "
        "and what it would say goes to a log function that says nothing",
    ),
    **mutants(
        "spes.node.x__another_layout",
        "5",
        "a change's key split off at its last ': ' (rpartition): a layout key's values are numbers and truth values "
        "(one ': '), and the text before a later ': ' of any other change starts with that key and ': ', no layout key",
    ),
    **mutants("spes.node.x__train", "4", "the log function's return value: nothing reads it"),
    **mutants("spes.node.x_build_node", "70", "typing.cast's type: it does nothing at run time"),
    **mutants(
        "spes.schema.x__lookup_field",
        "10",
        "the unknown key as written is read only for its last part, which 'XX.XX' joins prefix with 'XX': among the "
        "config's key names no closest match changes for it (each checked), and a one-part key has no join",
    ),
    **mutants("spes.checkpoint.x_load_model_state", "2", "with_optim=None: a falsy flag reads the model alone too"),
    **mutants(
        "spes.checkpoint.x__dcp_load",
        "1 4 7",
        "DCP's load with or without its collective planning: without a process group it runs in this process either "
        "way, and under FSDP2 each rank reads the bytes of its own shards either way (checked: the FSDP test passes "
        "with no_dist=True)",
    ),
    **mutants(
        "spes.checkpoint.x__read_sharded",
        "15 18 19",
        "no_dist for a whole read: no caller reads a sharded checkpoint whole under a process group (export, "
        "unshard and an unsharded restore run in one process or read the unsharded kind)",
    ),
    **mutants(
        "spes.checkpoint.x__restore_sliced",
        "56 62",
        "full=None reads as False; full=True: torch's set_*_state_dict takes DTensor values as the shards they are "
        "(checked: the FSDP test passes with it)",
    ),
    **mutants("spes.checkpoint.x__options", "4 6", _CPU_OFFLOAD),
    **mutants("spes.checkpoint.x__load_state", "3 6", _CPU_OFFLOAD),
    **mutants(
        "spes.checkpoint.x__load_state",
        "18 22",
        "the options of a whole optimizer state's load: it only ever goes into a model of plain tensors (a single or "
        "DDP process; FSDP2 ranks restore by slices and a re-blocked restore carries no optimizer state), which "
        "full_state_dict leaves as it is",
    ),
    **mutants("spes.checkpoint.x__optim_state_dict", "16 19", _CPU_OFFLOAD),
    **mutants("spes.checkpoint.x_model_state_dict", "14 17", _CPU_OFFLOAD),
    **mutants(
        "spes.checkpoint.x__restore_unsharded",
        "16",
        "the optimizer's shapes read with with_optim false: _restore_sliced drops them by with_optim itself",
    ),
    **mutants(
        "spes.checkpoint.x_save_checkpoint",
        "33 34",
        "pruning compares a kind with 'sharded' only: any other string is the unsharded kind",
    ),
    **mutants(
        "spes.checkpoint.x__write_meta",
        "7",
        "sort_keys=None: yaml sorts a mapping's keys only when sort_keys is truthy, as for False",
    ),
    **mutants(
        "spes.sync.closing.xǁRoundCloserǁ_fail",
        "5",
        "logging formats a message with % only when it has arguments: without any it is logged as it is",
    ),
    **mutants(
        "spes.sync.downloads.x_uncopied_owners",
        "2",
        "a DiLoCo spec (the other way past the check) has no owned blocks: spec.owner is None for every tensor",
    ),
    **mutants(
        "spes.sync.downloads.xǁDownloadsǁ_await_round",
        "10",
        "> for >= against the monotonic clock: equal only at one instant, and the next poll gives up",
    ),
    **mutants(
        "spes.sync.downloads.xǁDownloadsǁ_await_round",
        "42 43 45",
        "a wait bounded by WAIT_POLL_S anyway: the download re-checks its round and deadline at the next poll "
        "(a quorum close or a give-up at most that much later)",
    ),
    **mutants("spes.sync.downloads.xǁDownloadsǁ_outgoing", "2", "an assertion for the type checker that always holds"),
    **mutants(
        "spes.sync.downloads.xǁDownloadsǁ_outgoing",
        "13 14",
        "every codec's whole selection is of the tensors the global model holds, and a delta selection's names "
        "are restricted to the round's fragment and downloads as the global model's are",
    ),
    **mutants(
        "spes.shards.x__resolve_entry",
        "47 49",
        "encoding 'UTF-8' or the locale's: Python reads the C locale as UTF-8 (PEP 538), so no machine these tests "
        "run on tells them apart; the explicit encoding keeps a list file readable under any other locale",
    ),
    **mutants(
        "spes.shards.x_find_shard_info", "18", "the sidecar's encoding, as the list file's (47 49 of _resolve_entry)"
    ),
    **mutants(
        "spes.atomic.x_hold_lock",
        "33",
        "the lock file truncated to one byte before the holder's line is written over it from byte 0: that line is "
        "longer than one byte, so the file holds just it either way",
    ),
    **mutants(
        "spes.shards.x__looks_uint16",
        "9",
        "the head cut to whole uint32 values: read as uint32, the file's size is a multiple of 4 (checked first) and "
        "its head is the whole file or its first 4,096 bytes, so there is nothing to cut",
    ),
    **mutants(
        "spes.shards.x_open_token_array",
        "29 32 35",
        "allow_pickle with mmap_mode='r': numpy refuses to map an object array whatever the flag says ('Array can't "
        "be memory-mapped: Python objects in dtype', checked); the flag states the rule where a mutant drops the map",
    ),
    **mutants(
        "spes.sync.retry.x_retrying",
        "3",
        "'' for None as the first refusal's time: both are false, so `duplicate_since or time.monotonic()` starts it",
    ),
    **mutants(
        "spes.hub.x_looks_like_repo_id",
        "7 8",
        "the '.' and '~' a path starts with: the id pattern already wants a letter or digit first",
    ),
    **mutants(
        "spes.hub.x_missing_model_file",
        "23 25",
        _UTF8,
    ),
    **mutants(
        "spes.hub.x_hub_offline",
        "8",
        "the value of an unset HF_HUB_OFFLINE: '' and 'xxxx' are both not among the true spellings",
    ),
    **mutants(
        "spes.tokenizer.x__read_tokenizer_config",
        "4 6",
        "the config's encoding, as a list file's (41 43 of spes.shards._resolve_entry)",
    ),
    **mutants("spes.tokenizer.x_load_tokenizer", "21", "'UTF-8' and 'utf-8' name one codec"),
    **mutants(
        "spes.sync.codecs.registry.x_build_codec",
        "21 22",
        "how many close matches difflib returns: only the best, the first, is named",
    ),
    **mutants(
        "spes.sync.settings.x__is_loopback",
        "7",
        "'X' stripped from a host's ends too: no IP address (what is asked next) begins or ends with one",
    ),
    **mutants("spes.sync.settings.x_add_deploy_flags", "24", "every field of DeployConfig has a default"),
    **mutants("spes.sync.settings.x_build_parser", "9", "allow_abbrev=None: argparse tests it for truth, as False"),
    **mutants("spes.sync.settings.x_build_parser", "73", "RUN.yaml's default=None: argparse's default already"),
    **mutants(
        "spes.sync.settings.x_add_deploy_flags",
        "31 35",
        "a switch's dest left to argparse: it derives the field's own name from `--<name>` (only the token's flag, "
        "no switch, is named otherwise)",
    ),
    **mutants(
        "spes.sync.presence.x_retry_wait",
        "19",
        "the exponent's bound 17 for 16: the wait reaches REFUSED_RETRY_MAX_S from the 6th refusal on either way",
    ),
    **mutants(
        "spes.sync.presence.xǁPresenceǁ__init__",
        "5",
        "'' for None as the last refusal said: a refusal's details are never empty (the server words each one)",
    ),
}
"""Surviving mutants no test can kill, by mutmut's name, with the reason (the behaviour they change is none)."""

AGREE = "tests/test_guard.py::test_every_rank_agrees_on_one_ranks_nan"
CUDA_PEER = "tests/sync/codecs/test_held.py::test_a_peer_training_on_cuda_sends_deltas_against_its_cpu_held_model"
GPU_HEAD = "tests/test_head_loss.py::test_on_a_gpu_the_weight_gradient_is_accumulated_in_fp32_inside_the_gemm"
GPU_MOE = "tests/test_moe.py::test_on_a_gpu_auto_is_grouped_mm_and_a_peers_layer_runs_there"
SERVER = "tests/sync/test_server.py::"
FSDP_CKPT = "tests/test_checkpoint.py::test_fsdp_checkpoints_of_either_kind_restore_every_ranks_shards_exactly"
GPU_PEAK_MEMORY = "tests/test_monitor.py::test_peak_gpu_memory_is_the_allocators_peak_in_megabytes"
FLAG_GROUPS = "tests/sync/test_settings.py::test_each_flag_stands_in_its_group_with_its_doc_and_default"
HUB_ONLINE = "tests/test_hub.py::test_an_id_the_hub_does_not_know_is_named_with_what_to_check"
HUB_DOWNLOAD = "tests/test_hub.py::test_a_hub_id_is_downloaded_once_into_the_cache_with_only_the_files_spes_reads"
KILLED_BY: dict[str, str] = {
    # a --watch's line through a pipe while the command runs: a process of its own
    **mutants(
        "spes.status.x_ask",
        "47 49 54",
        "tests/test_status_cli.py::test_watch_through_a_pipe_prints_each_line_as_it_asks_and_sigint_ends_it_with_exit_0",
    ),
    # the evaluated model gathered whole from its FSDP2 shards, on two gloo ranks (torchrun)
    **mutants(
        "spes.evaluators.xǁDownstreamEvalsǁrun",
        "3 5 6",
        "tests/test_evaluators.py::test_an_fsdp_model_is_gathered_whole_for_its_evaluation",
    ),
    # the state-dict options that only sharded (FSDP2) parameters read, on two gloo ranks (torchrun)
    **mutants("spes.checkpoint.x__options", "1 2 3 5 7", FSDP_CKPT),
    **mutants("spes.checkpoint.x__load_state", "1 2 9 12", FSDP_CKPT),
    **mutants("spes.checkpoint.x_model_state_dict", "1 10 12 13", FSDP_CKPT),
    **mutants("spes.checkpoint.x__optim_state_dict", "1 11 14 15", FSDP_CKPT),
    **mutants("spes.checkpoint.x__restore_unsharded", "10 13 78 84", FSDP_CKPT),  # reblocked, and read by slices
    **mutants("spes.checkpoint.x_save", "19 21 22 31 34 35", FSDP_CKPT),
    **mutants("spes.checkpoint.x_save_sharded_checkpoint", "72", FSDP_CKPT),  # the other ranks' message
    # what a whole in-process server keeps from round to round: buffers of the wire's dtype, verified checksums
    **mutants(
        "spes.sync.uploads.xǁUploadsǁ_decode",
        "9 13",
        f"{SERVER}test_upload_buffers_are_reused_but_never_while_a_download_reads_them",
    ),
    **mutants(
        "spes.sync.uploads.xǁUploadsǁreceive",
        "73",
        f"{SERVER}test_downloads_hash_again_only_what_the_round_changed[grpc]",
    ),
    **mutants(
        "spes.sync.closing.xǁRoundCloserǁ_run",
        "12 20",
        f"{SERVER}test_bf16_rounds_sum_their_fp32_means_into_kept_buffers",
    ),
    # a whole server (the one the health service stalls): run apart, not for every mutant of admission.py
    **mutants(
        "spes.sync.admission.xǁGuardedHealthǁ__init__",
        "2",
        "tests/sync/test_server.py::test_a_health_watcher_that_never_reads_blocks_neither_health_nor_stop",
    ),
    # FSDP2 DTensor shards, on two gloo ranks (torchrun): too slow to run for every mutant of the model
    **mutants(
        "spes.model.x_assign_whole",
        "1 2 3 4 5 6 7 8 10",
        "tests/test_distributed.py::test_fsdp_ranks_initialize_only_their_shards_to_the_unsharded_values[fsdp]",
    ),
    **mutants("spes.guard.x_check_weights_finite", "8 10 11", f"{AGREE}[gloo]"),  # a clean rank's message
    # a CUDA tensor's bytes read without moving it to the host first
    **mutants(
        "spes.sync.wire.x__wire_pieces",
        "17 19",
        "tests/sync/test_wire.py::test_a_cuda_tensor_is_sent_as_its_host_bytes",
    ),
    # a delta measured or applied across devices: CUDA trained tensors, a CPU held model and carried error
    **mutants("spes.sync.codecs.held.x__add", "13 14", f"{CUDA_PEER}[sparse]"),
    **mutants("spes.sync.codecs.held.x__plus", "21", f"{CUDA_PEER}[int8]"),
    **mutants("spes.sync.codecs.held.x_encode_delta", "15 19", CUDA_PEER),
    # the fp32-accumulating GEMM of `fused_loss`'s head, which only a GPU runs
    **mutants("spes.head_loss.x__add_product", "7 14 18 19", GPU_HEAD),
    **mutants("spes.head_loss.x__gemm_accumulates_fp32", "5 6", GPU_HEAD),
    **mutants("spes.head_loss.xǁChunkFnsǁcompiled", "1 2 3 4 5 6 7 8 9 10", COMPILED_HEAD),
    # what a CUDA device makes of a MoE layer: auto's choice, and tensors made on the layer's device
    **mutants("spes.moe.x_resolve_backend", "6 7 12 13", GPU_MOE),
    **mutants("spes.moe.xǁMoEǁforward", "44 46", GPU_MOE),
    **mutants("spes.moe.xǁMoEǁset_own_count_scale", "8 10", GPU_MOE),
    **mutants(
        "spes.data.x_repetitive_instances", "5 8 26 28", "tests/test_data.py::test_the_repetition_filter_runs_on_a_gpu"
    ),
    # the peak GPU memory a node logs, which only a GPU has
    **mutants("spes.monitor.x_peak_memory_mb", "2 3 4 5 7 9 11 18", GPU_PEAK_MEMORY),
    # the server's flags as DeployConfig's fields declare them: made when the module is imported, outside every test
    **mutants("spes.sync.settings.x__flag", "1 2 3 4 5 6 7 8", FLAG_GROUPS),
    # the online path, in a process of its own against a Hub endpoint on loopback (huggingface_hub reads HF_ENDPOINT
    # as it is imported): one ask after the offline lookup, the download's arguments, the one-line refusal
    **mutants("spes.hub.x_resolve", "15 19 21 56 57 58 59 60 61 62 63 64 65 66", HUB_ONLINE),
    **mutants("spes.hub.x_resolve", "14 18 48 49 50 51 52 53 54 55", HUB_DOWNLOAD),
    **mutants("spes.hub.x_resolve_tokenizer", "9", HUB_DOWNLOAD),
    # the sync counter, run outside mutmut (whose frames sit between a counted call and its caller)
    **mutants("spes.speed.xǁSyncCounterǁ__init__", "1", SYNC_COUNTED[0]),
    **mutants("spes.speed.xǁSyncCounterǁ__torch_function__", "1 2 3 4 5 6 7 8 9", SYNC_COUNTED[0]),
    **mutants("spes.speed.x__spes_caller", "1 2 4 5 6 7 8 9 10 11 12", SYNC_COUNTED[0]),
}
"""Mutants killed by a test mutmut cannot credit (it starts processes, whose calls mutmut does not trace), by name:
the test that kills each. Every run checks it: the mutant is applied to the scratch copy and the test must fail
(a test marked gpu is not run without CUDA, and the mutant is recorded as unverified)."""

COPIED = ("spes", "tests", "configs", "data_process_scripts", "run_scripts", "docs", "README.md")
"""What the scratch copy holds besides pyproject.toml: the package, its tests and what the tests read (the commands
the README and docs write)."""
PYTEST_ARGS = ("-p", "no:cacheprovider", "-n", "0", "-q")


def mutmut_settings(module: str, tests: tuple[str, ...]) -> str:
    """The [tool.mutmut] table of a scratch copy: mutate `module` only, test with `tests` only."""
    settings = {
        "source_paths": ["spes"],
        "only_mutate": [module],
        "also_copy": [p for p in COPIED if p != "spes"],
        "pytest_add_cli_args": list(PYTEST_ARGS),
        "pytest_add_cli_args_test_selection": list(tests),
        "use_git_change_detection": False,
        # NOTE: mutmut ends a mutant's tests after 15 x (their clean time + this many seconds); 5 puts that past the
        # 60 s per-test timeouts of the covering tests, so a mutant that makes one loop forever fails that test
        # (killed) instead of running out mutmut's clock first (a timeout, whichever test mutmut happened to run first)
        "timeout_constant": 5.0,
    }
    return "\n[tool.mutmut]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items())


def scratch_copy(module: str, tests: tuple[str, ...], into: Path) -> None:
    """The repository's package, tests and configs in `into`, with a pyproject.toml that configures mutmut."""
    for name in COPIED:
        if (REPO_ROOT / name).is_file():
            shutil.copy2(REPO_ROOT / name, into / name)
        else:
            shutil.copytree(REPO_ROOT / name, into / name, ignore=shutil.ignore_patterns("__pycache__"))
    text = (REPO_ROOT / "pyproject.toml").read_text()
    (into / "pyproject.toml").write_text(text + mutmut_settings(module, tests))


def mutmut(scratch: Path, *args: str, timeout_s: float = 600) -> str:
    """`python -m mutmut ARGS` in `scratch`; its output. On timeout the whole process group (workers too) is
    killed and TimeoutError raised."""
    log = scratch / "mutmut.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mutmut", *args],
            cwd=scratch,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(f"mutmut {' '.join(args)} ran past {timeout_s:.0f} s") from None
    text = log.read_text(errors="replace")
    if code != 0:
        raise RuntimeError(f"mutmut {' '.join(args)} exited with {code}:\n{text[-3000:]}")
    return text


def statuses(scratch: Path) -> dict[str, str]:
    """Every mutant's status (killed, survived, no tests, timeout, not checked...), by mutmut's name for it."""
    found = re.findall(r"^\s+(\S+): (.+)$", mutmut(scratch, "results", "--all", "true"), re.M)
    return {name: status.strip() for name, status in found}


def location(module: str, name: str, diff: str) -> str:
    """`path:line (function)` of the first line a mutant changes, found in the unmutated function's lines.

    mutmut names a function's mutants `<module>.x_<function>__mutmut_<n>`, a method's `<module>.xǁ<class>ǁ<method>...`.
    """
    qualified = name.rsplit("__mutmut_", 1)[0].split(".")[-1]
    owner, function = qualified[2:].split("ǁ", 1) if qualified.startswith("xǁ") else ("", qualified[2:])
    source = (REPO_ROOT / module).read_text()
    tree = ast.parse(source)
    classes: list[ast.AST] = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == owner]
    scopes = classes or [tree]
    # NOTE: mutmut's diff shows a method dedented out of its class: its lines are matched at the def's indentation
    spans = [
        (node.lineno, node.end_lineno or node.lineno, " " * node.col_offset)
        for scope in scopes
        for node in ast.iter_child_nodes(scope)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function
    ]
    removed = next((line[1:] for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")), "")
    lines = source.splitlines()
    for start, end, indent in spans:
        for number in range(start, end + 1):
            if removed and lines[number - 1] == indent + removed:
                return f"{module}:{number} ({function})"
    return f"{module}:{spans[0][0] if spans else '?'} ({function})"


def run_module(module: str, tests: tuple[str, ...], timeout_s: float, recheck: tuple[str, ...] = ()) -> dict[str, Any]:
    """Mutate `module` in a scratch copy, run its tests against every mutant (or only the mutants `recheck`, the
    others counted as killed, as the record they come from found them); its scores and mutants not killed."""
    with tempfile.TemporaryDirectory(prefix="spes-mutation-") as tmp:
        scratch = Path(tmp)
        scratch_copy(module, tests, scratch)
        start = time.monotonic()
        complete = True
        try:
            mutmut(scratch, "run", "--max-children", "1", *recheck, timeout_s=timeout_s)
        except TimeoutError as exc:
            print(f"{module}: {exc}; recording the mutants checked so far", file=sys.stderr)
            complete = False
        seconds = time.monotonic() - start
        found = statuses(scratch)
        if recheck:
            found = {n: s if n in recheck or s != "not checked" else "killed" for n, s in found.items()}
        survivors = []
        for name, status in sorted(found.items(), key=lambda item: natural(item[0])):
            if status == "killed":
                continue
            diff = mutmut(scratch, "show", name).split("\n", 1)[1].strip()
            entry: dict[str, Any] = {
                "name": name,
                "status": status,
                "location": location(module, name, diff),
                "diff": diff,
            }
            if name in KILLED_BY:
                entry["killed_by"] = {"test": KILLED_BY[name], "verified": killed_by(scratch, module, name)}
            survivors.append({**entry, "equivalent": EQUIVALENT.get(name)})
    return summary(module, tests, found, survivors, seconds, complete)


def natural(name: str) -> tuple[str, int]:
    """Sort key of a mutant name: its function, then its number (mutmut_9 before mutmut_10)."""
    function, _, number = name.rpartition("__mutmut_")
    return function, int(number) if number.isdigit() else -1


def killed_by(scratch: Path, module: str, name: str) -> bool | None:
    """Whether KILLED_BY[name] fails with the mutant applied to the scratch copy (None: a GPU test, no CUDA here)."""
    test = KILLED_BY[name]
    gpu = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", test],
        cwd=scratch,
        capture_output=True,
        text=True,
    )
    if gpu.returncode == 0 and not torch_has_cuda():
        return None
    mutmut(scratch, "apply", name)
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", *PYTEST_ARGS, test], cwd=scratch, capture_output=True)
        # a failed test, or its process ended by a signal (a crash in native code, e.g. gRPC's core aborting); not an
        # error of collection or usage
        return done.returncode == 1 or done.returncode < 0
    finally:
        shutil.copy2(REPO_ROOT / module, scratch / module)


def torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def summary(
    module: str,
    tests: tuple[str, ...],
    found: dict[str, str],
    survivors: list[dict[str, Any]],
    seconds: float,
    complete: bool,
) -> dict[str, Any]:
    """A module's record: counts per status, the scores with and without the equivalent mutants, the survivors."""
    counts: dict[str, int] = {}
    for status in found.values():
        counts[status] = counts.get(status, 0) + 1
    verified = sum(1 for s in survivors if s.get("killed_by", {}).get("verified"))
    # NOTE: a mutant that made its tests run past mutmut's timeout (an endless loop) is caught, as mutation tools count
    killed, total = counts.get("killed", 0) + counts.get("timeout", 0) + verified, len(found)
    equivalent = sum(1 for s in survivors if s["equivalent"])
    # an equivalent mutant that timed out (its tests slowed by a loaded machine) is left out of both sides: caught,
    # it would count once in each and score the others above 1
    caught_equivalent = sum(1 for s in survivors if s["equivalent"] and s["status"] == "timeout")
    # an entry naming a mutant that is killed or gone: renumbered by a change to the module, or killed by a new test
    stale = sorted(
        n
        for n in (*EQUIVALENT, *KILLED_BY)
        if n.startswith(module_prefix(module)) and found.get(n, "killed") == "killed"
    )
    return {
        "tests": list(tests),
        "mutants": total,
        "by_status": dict(sorted(counts.items())),
        "killed_by_tests_mutmut_cannot_credit": verified,
        "score": round(killed / total, 4) if total else None,
        "score_without_equivalent": (
            round((killed - caught_equivalent) / (total - equivalent), 4) if total > equivalent else None
        ),
        "complete": complete,
        "seconds": round(seconds, 1),
        "survivors": survivors,
        **({"stale_entries": stale} if stale else {}),
    }


def module_prefix(module: str) -> str:
    """mutmut's name prefix of a module's mutants: spes/sync/merge.py -> spes.sync.merge."""
    return module.removesuffix(".py").replace("/", ".") + "."


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench/mutation.py", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("modules", nargs="*", help=f"modules to run (default: all of {', '.join(MODULES)})")
    p.add_argument("--timeout_min", type=float, default=60.0, help="stop a module's run after this many minutes")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "mutation.json", help="the JSON record")
    p.add_argument("--list", action="store_true", help="print the modules and their tests, run nothing")
    p.add_argument(
        "--recheck",
        action="store_true",
        help="run only the mutants the record lists as not killed (after adding tests; the module itself unchanged)",
    )
    args = p.parse_args(argv)
    chosen = chosen_modules(p, args.modules)
    if args.list:
        for module in chosen:
            print(f"{module}: {' '.join(MODULES[module])}")
        return
    if not args.timeout_min > 0:
        p.error(f"--timeout_min must be a number of minutes above 0, got {args.timeout_min:g}")
    modules = dict(read_record(p, args.out).get("modules", {}))
    # every module's refusal before any runs: a module takes minutes to an hour
    rechecks = {module: rechecked(modules.get(module), module) for module in chosen} if args.recheck else {}
    command = command_line(None if argv is None else [p.prog, *argv])
    for module in chosen:
        if args.recheck and not rechecks[module]:
            print(f"{module}: nothing to recheck, its record has every mutant killed", flush=True)
            continue
        print(f"{module}: mutating, tests {' '.join(MODULES[module])}", flush=True)
        commit, previous = git_commit(), modules.get(module)
        result = run_module(module, MODULES[module], args.timeout_min * 60, rechecks.get(module, ()))
        modules[module] = {"command": command, "commit": commit, "machine": machine_info(), **result}
        if args.recheck and previous is not None:
            modules[module]["rechecked_from"] = {"commit": previous["commit"], "mutants": list(rechecks[module])}
        print(
            f"{module}: {result['score']} of {result['mutants']} mutants killed, {result['score_without_equivalent']} "
            f"of those not equivalent ({result['by_status']})"
        )
        # after each module: a later module's failure does not lose what the earlier ones took minutes to find
        write_record(args.out, modules)


def write_record(path: Path, modules: dict[str, Any]) -> None:
    """Write the record atomically: the tool, and per module the run that produced its part (command, commit,
    machine). No command or commit of its own: the record is many runs', each module's from the last run of it."""
    record = {"tool": f"mutmut {mutmut_version()}", "modules": dict(sorted(modules.items()))}
    write_atomic(path, json.dumps(record, indent=1) + "\n")
    print(f"saved {path}")


def chosen_modules(p: argparse.ArgumentParser, names: list[str]) -> list[str]:
    """The modules named, as MODULES names them (each once; every module when none is named). A name is a path from
    the repository's root or from here (`./spes/sync/merge.py`, an absolute path); refuses one that is no file, or
    a module without covering tests."""
    chosen = list(dict.fromkeys(module_name(name) for name in names)) or list(MODULES)
    missing = [module for module in chosen if not (REPO_ROOT / module).is_file()]
    if missing:
        p.error(f"no such module: {', '.join(missing)} (name it as --list does, e.g. spes/sync/merge.py)")
    unknown = [module for module in chosen if module not in MODULES]
    if unknown:
        p.error(f"no covering tests listed for {unknown}: add the module to MODULES in bench/mutation.py")
    return chosen


def module_name(name: str) -> str:
    """`name` as a path from the repository's root: as given when it is one, else resolved from here."""
    path = Path(name)
    if not path.is_absolute() and (REPO_ROOT / path).is_file():
        return path.as_posix()
    path = path.resolve()
    return path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else name


def read_record(p: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """The record at `path` ({} when there is none yet); refuses one that is not a JSON object."""
    if not path.exists():
        return {}
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        p.error(f"--out {path} is not a readable JSON record ({exc}): give another --out, or move that file away")
    if not isinstance(record, dict):
        p.error(f"--out {path} holds no record (a JSON object): give another --out, or move that file away")
    return record


def rechecked(previous: dict[str, Any] | None, module: str) -> tuple[str, ...]:
    """The mutants `previous` (a module's record) did not see killed; refuses when the module changed since."""
    if previous is None or not previous.get("complete"):
        raise SystemExit(f"error: --recheck needs a complete record of {module}: run it whole first")
    then = previous["commit"].split("-dirty", 1)[0]  # `<commit>-dirty-<hash>`: the module as that commit has it
    source = subprocess.run(["git", "show", f"{then}:{module}"], cwd=REPO_ROOT, capture_output=True, text=True)
    if source.returncode != 0 or source.stdout != (REPO_ROOT / module).read_text():
        raise SystemExit(f"error: {module} changed since its record's commit {then[:12]}: run it whole, not --recheck")
    return tuple(s["name"] for s in previous["survivors"])


def mutmut_version() -> str:
    from importlib.metadata import version

    return version("mutmut")


if __name__ == "__main__":
    main()
