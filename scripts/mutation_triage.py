"""Surviving mutants triaged by hand, per module (read by ``scripts/mutation.py`` for its report).

Each entry names a mutant (mutmut's name without the ``gym_ray.<module>.`` prefix) and why no test kills
it: *equivalent* (no input can tell it from the original: a value overwritten before it is read, a fast
path that falls back to the general one, a layout or naming detail), or *not reached here* (a branch the
mutation run's test selection leaves out, with the test that covers it). Mutant numbers are per
function: when a function changes, its entries must be checked again (the report lists any triaged name
that no longer survives or exists, so stale entries show).
"""

from __future__ import annotations

_NONE_FALSE = "None and False read alike where the value is only tested for truth"


def _same(reason: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, reason)


TRIAGED: dict[str, dict[str, str]] = {
    "record/writer.py": {
        **_same(
            "config_identity is stored but never read by the writer (the manifest carries its own)",
            "xǁShardWriterǁ__init____mutmut_21",
        ),
        **_same(
            "initial value replaced before any read: open() makes the token; the failure and stale fields "
            "are read only in the states that set them; None/False/'' read alike",
            *(f"xǁShardWriterǁ__init____mutmut_{n}" for n in (30, 31, 32, 34, 35)),
        ),
        **_same(
            "os.close of the writer's own descriptors fails only on an I/O error at close, which a local "
            "file system does not produce",
            "xǁShardWriterǁ_close_fds__mutmut_3",
        ),
        **_same(
            "the errno name of an OSError without a known errno: message wording only",
            *(f"xǁShardWriterǁ_fail__mutmut_{n}" for n in (3, 5, 7, 8)),
        ),
        **_same(
            "the token's random length and JSON spacing: it stays unique and parseable",
            *(f"xǁShardWriterǁ_make_token__mutmut_{n}" for n in (4, 5, 16, 18)),
        ),
        **_same("the file name in a log line", *(f"xǁShardWriterǁ_repair__mutmut_{n}" for n in (8, 10, 11))),
        **_same(_NONE_FALSE, "xǁShardWriterǁ_seed_counts__mutmut_3"),
        **_same(
            "closing an already closed writer does nothing either way",
            "xǁShardWriterǁclose__mutmut_4",
            "xǁShardWriterǁclose__mutmut_5",
        ),
        **_same(
            "JSON indentation of files that are read with a JSON parser",
            "xǁShardWriterǁwrite_manifest__mutmut_10",
            "xǁShardWriterǁwrite_manifest__mutmut_11",
            "xǁShardWriterǁwrite_progress__mutmut_7",
            "xǁShardWriterǁwrite_progress__mutmut_8",
        ),
    },
    "record/recording.py": {
        **_same(
            "_total is set by stamp() (and by the resume plan) before any row runs",
            "xǁShardRecorderǁ__init____mutmut_36",
            "xǁShardRecorderǁ__init____mutmut_37",
        ),
        **_same(_NONE_FALSE, *(f"xǁShardRecorderǁ__init____mutmut_{n}" for n in (42, 44, 46, 48, 50))),
        **_same(
            "_opened only decides whether closing closes the writer; closing a writer never opened does "
            "nothing",
            "xǁShardRecorderǁ__init____mutmut_45",
        ),
        **_same(
            "zip(strict=...) right after an explicit length check",
            *(f"xǁShardRecorderǁ_check_resume__mutmut_{n}" for n in (17, 20, 21)),
            *(f"xǁShardRecorderǁ_check_same_rows__mutmut_{n}" for n in (14, 17, 18)),
        ),
        **_same(
            "a corrupt materialized row is refused in the same call by stamp()'s strict read, with the same "
            "InputError naming file and line",
            *(f"xǁShardRecorderǁ_recorded_run_id__mutmut_{n}" for n in (10, 12, 13)),
        ),
        **_same(
            "reached only by a hand-edited inputs file whose run id is not a string",
            "xǁShardRecorderǁ_recorded_run_id__mutmut_17",
        ),
        **_same(
            "record_failure_row does not use its row argument (it keeps the hook's shape)",
            "xǁShardRecorderǁfailure_recorder__mutmut_1",
        ),
    },
    "finalize/_merge_shard.py": {
        **_same(
            "the read bound (the file's size at open) differs only for a file that grows or shrinks while "
            "it is merged, which merge.py's docstring rules out (merge a run once its writers are done); a "
            "FIFO or device has size 0 either way; one more read of 0 bytes at the end",
            *(f"x_file_line_batches__mutmut_{n}" for n in (10, 15, 27, 28, 29)),
        ),
        **_same(
            "spans sorted by (first, last), by the part's span or by their last identity: the same order "
            "when no two overlap, and an overlap is found either way (sorted by last, l1 <= l2 and l1 < f2 "
            "make the spans disjoint); equal spans compare the parts' distinct paths, never their tallies",
            *(f"x_in_identity_order__mutmut_{n}" for n in (3, 5, 8, 9)),
        ),
        **_same(
            "sentinels never equal to an entry's task, rollout or attempt (ints, or bytes from _entries)",
            *(f"x_keep_lines__mutmut_{n}" for n in (5, 6, 7, 22)),
        ),
        **_same(
            "flushing at 4,097 lines instead of 4,096", "x_keep_lines__mutmut_36", "x_keep_lines__mutmut_60"
        ),
        **_same(
            "= instead of += on the outcome counts: both callers pass a Tally whose outcome counts are 0 (a "
            "fresh one per shard in reduce_shard, per pass in _merge_sorted)",
            *(f"x_keep_lines__mutmut_{n}" for n in (78, 80, 82, 84, 86, 88)),
        ),
        **_same(
            "orjson is a fast path: a line it is not given, or refuses, goes to parse_record, which gives "
            "the same verdict and values (test_merge_classifies_mutated_lines_like_the_jsonl_reader)",
            *(f"x_read_shard__mutmut_{n}" for n in (21, 23, 25)),
        ),
        **_same(
            "an index read as not an int on the fast path is read again exactly with parse_record: the "
            "same task, rollout and attempt (None there becomes attempt 0, as .get(key, 0) gives)",
            *(f"x_read_shard__mutmut_{n}" for n in (42, 43, 44, 45, 46, 48, 49, 50, 54, 56, 58)),
        ),
        **_same("the in-shard sequence only has to grow to keep file order", "x_read_shard__mutmut_85"),
        **_same("file buffering: same bytes", "x_reduce_shard__mutmut_13", "x_reduce_shard__mutmut_19"),
        **_same(
            "a shard without lines (span None) is left out by in_identity_order before its paths are read",
            "x_reduce_shard__mutmut_32",
            "x_reduce_shard__mutmut_33",
        ),
    },
    "finalize/merge.py": {
        **_same("a wider key layout than needed is still exact", "x__hex_digits__mutmut_3"),
        **_same(
            "the name of the temp folder in the run folder: removed either way (tests check nothing is left)",
            *(f"x__merge__mutmut_{n}" for n in (3, 5, 6, 7)),
            *(f"x__merge_sorted__mutmut_{n}" for n in (3, 5, 6, 7)),
        ),
        **_same(
            "the widened layout's size: any width that holds the indices gives the same order (a narrower "
            "one than needed restarts again), and _WidthExceeded's exception argument is never shown",
            "x__merge__mutmut_55",
            "x__merge__mutmut_56",
            "x__wide_key__mutmut_11",
            "xǁ_WidthExceededǁ__init____mutmut_1",
        ),
        **_same(
            "upper-case hex in the wide layout: a pass at width 16 keys every line by the packed key (an "
            "index the packed key cannot hold needs more than 16 digits), wider passes every line by "
            "_wide_key, so cases never mix; the kind and terminal digits are 0 or 1 either way",
            "x__wide_key__mutmut_22",
        ),
        **_same(
            "names of intermediate files, one extra merge pass, buffering and copy chunk sizes: same bytes",
            *(f"x__reduce_runs__mutmut_{n}" for n in (2, 3, 5, 6, 24)),
            "x__sort_shard__mutmut_65",
            "x__append_file__mutmut_6",
            "x__append_file__mutmut_9",
        ),
        **_same(
            "the packed 64-bit key is a fast path: a missing or None field raises struct.error, which falls "
            "back to _wide_key's identical bytes (the offset's sign is killed by test_indices_just_past_the_"
            "signed_64_bit_range_order_like_integers)",
            *(f"x__sort_shard__mutmut_{n}" for n in range(12, 26)),
        ),
        **_same(
            "the attempt slice starting 2 digits earlier takes in the rollout's last digits and the kind, "
            "equal for every failure of one identity (the only entries keep_lines compares attempts of)",
            "x__entries__mutmut_20",
        ),
        **_same("keep_lines never reads the sequence slot of an entry", "x__entries__mutmut_22"),
        **_same(
            "platforms without os.sched_getaffinity only",
            *(f"x__usable_cpus__mutmut_{n}" for n in (1, 5, 6, 7, 8)),
        ),
        **_same(
            "the default fan_in bounds open files only; the output is the same", "x_merge_shards__mutmut_3"
        ),
        **_same(
            "pool only: killed by test_process_pool_writes_the_same_bytes_and_counts_as_in_process, "
            "deselected in the mutation run (15 s: every pool process imports the mutated package); "
            "in-process sorting of the general way writes the same bytes",
            "x__each_shard__mutmut_23",
            "x__merge__mutmut_42",
            "x__merge_sorted__mutmut_13",
        ),
        **_same(
            "a sorting process that dies (BrokenExecutor): not produced by any test",
            "x_merge_shards__mutmut_119",
        ),
    },
    "dispatch/_completion.py": {
        **_same(
            "re-awaiting the finished prepare task returns at once: _prepared only saves that await",
            "xǁCompletionIteratorǁ_ensure_prepared__mutmut_7",
            "xǁCompletionIteratorǁ_ensure_prepared__mutmut_8",
        ),
        **_same(
            "the closed mode is only compared with 'aclose', so any other text reads as 'drain'",
            "xǁCompletionIteratorǁaclose_and_drain__mutmut_7",
            "xǁCompletionIteratorǁaclose_and_drain__mutmut_8",
        ),
        **_same(
            "a repeated close joins what the first close already joined; with no loop recorded no task "
            "exists, so the loop is never used",
            "xǁCompletionIteratorǁaclose_and_drain__mutmut_2",
            "xǁCompletionIteratorǁaclose_and_drain__mutmut_5",
        ),
        **_same(
            "asyncio sends None into a coroutine, and a Future ignores the value sent to it",
            "xǁ_Completionǁsend__mutmut_1",
        ),
        **_same(
            "bounded iterators empty the ready queue when they close and never refill it",
            "xǁCompletionIteratorǁ_next_outcome__mutmut_4",
        ),
        **_same(
            "a waiter that is not done when its consumer is cancelled is cancelled, so both forms raise "
            "CancelledError",
            "xǁCompletionIteratorǁ_next_outcome__mutmut_18",
        ),
        **_same(
            "the never-happens InternalError's text",
            "xǁCompletionIteratorǁ_next_outcome__mutmut_12",
        ),
        **_same(
            "break and return are the same here: the admission loop is the last statement of the function",
            "xǁCompletionIteratorǁ_admit__mutmut_14",
        ),
        **_same(
            "the recorded loop only caches get_running_loop(): an iterator is used from one loop, so both "
            "give the same loop",
            "xǁCompletionIteratorǁ_admit__mutmut_4",
        ),
        **_same(
            "after a drain or a bounded aclose the ready queue is never read again (every later awaitable "
            "raises CancelledError and a repeated close returns []), so what is appended to it is unseen",
            "xǁCompletionIteratorǁ_on_done__mutmut_2",
        ),
        **_same(
            "a task reaches its done callback once, so a _moved entry left behind is only memory held "
            "until the iterator is dropped",
            "xǁCompletionIteratorǁ_on_done__mutmut_10",
        ),
        **_same(
            _NONE_FALSE + " (_closed is otherwise only compared with 'aclose'; _loop is only used as "
            "`self._loop or get_running_loop()`)",
            "xǁCompletionIteratorǁ__init____mutmut_24",
            "xǁCompletionIteratorǁ__init____mutmut_39",
            "xǁCompletionIteratorǁ__init____mutmut_41",
        ),
    },
    "record/shard_files.py": {
        **_same(
            "the read size of each chunk changes only memory use: the digest of the same bytes is the same",
            "x_file_sha256__mutmut_10",
            "x_file_sha256__mutmut_12",
            "x_file_sha256__mutmut_13",
        ),
        **_same(
            "a regular local file takes the whole pwrite in one call, so '=' and '+=' of the first (only) "
            "count agree",
            "xǁShardLockǁwrite_token__mutmut_10",
        ),
    },
    "finalize/aggregate.py": {
        **_same(
            "the streamed lists are empty stand-ins when the reply is checked, so leaving them in the "
            "strict-JSON encoding changes nothing",
            *(f"x__validate_reply__mutmut_{n}" for n in (25, 26, 27, 28, 29)),
        ),
        **_same(
            "a file entry takes each streamed list from the outcome's fragments, which replace the entry's "
            "empty stand-in (or its absence) under the same key",
            "x__entry__mutmut_26",
            "x__entry__mutmut_32",
            "x__entry__mutmut_33",
        ),
        **_same(
            "the per-server task's name is only shown by debugging tools",
            "x_aggregate_metrics__mutmut_28",
            "x_aggregate_metrics__mutmut_30",
        ),
        **_same(
            "_call_one sets the error whenever no reply is kept (cancellation ends the whole call), so the "
            "'no reply' fallback and the initial error value are never read",
            "x__entry__mutmut_8",
            "xǁ_Outcomeǁ__init____mutmut_3",
        ),
        **_same(
            "the merged file exists when it is read: _merged_file checked it or merge_shards just wrote it",
            "x__iter_records__mutmut_3",
            "x__iter_records__mutmut_6",
            "x__iter_records__mutmut_8",
        ),
        **_same(
            "pydantic's model_validate returns an instance of the model as it is",
            "x__read_entries__mutmut_7",
        ),
        **_same(_NONE_FALSE, "x_aggregate_run__mutmut_14"),
        **_same(
            "merge_shards always writes rollouts.jsonl (empty without successes), and aggregating no row "
            "returns None too",
            "x__merged_file__mutmut_8",
        ),
    },
    "plan/resume.py": {
        **_same(
            "iter_pending reads the inputs only when their (size, mtime_ns) stamp is the one planned, and "
            "planning read them strictly, so a lenient reader meets no corrupt line",
            *(f"xǁResumePlanǁiter_pending__mutmut_{n}" for n in (7, 9, 10)),
        ),
        **_same(_NONE_FALSE, "xǁResumePlanǁiter_pending__mutmut_21", "xǁResumePlanǁiter_pending__mutmut_23"),
    },
    "plan/validation.py": {
        **_same(
            "an entry kept without a taskset (key None) is never looked up, and one with a taskset but no "
            "allowed_agents (the config turns an empty list into None) adds a check that accepts every type",
            "xǁ_Validatorǁ__init____mutmut_11",
        ),
    },
    "finalize/_aggregate_spool.py": {
        **_same(
            "a spool line's key prefix holds no whitespace but its two single spaces and the JSON text "
            "starts with '{', so splitting on any whitespace gives the same three parts",
            "x__sorted_lines__mutmut_3",
            "xǁServerSpoolsǁwrite_body__mutmut_30",
        ),
        **_same(
            "the compact JSON text of an object ends with '}', so stripping any whitespace (or 'X') from "
            "its right strips only the line's newline",
            "xǁServerSpoolsǁwrite_body__mutmut_28",
            "xǁServerSpoolsǁwrite_body__mutmut_38",
        ),
        **_same(
            "an in-order spool sorted anyway (or a spool with equal keys marked unordered) gives the same "
            "bytes: the sort is stable and the lines already are in key order; only memory differs",
            "xǁServerSpoolsǁwrite_body__mutmut_19",
            "xǁServerSpoolsǁadd__mutmut_43",
            "xǁServerSpoolsǁadd__mutmut_44",
            "xǁ_Spoolǁ__init____mutmut_5",
            "xǁ_Spoolǁ__init____mutmut_6",
        ),
        **_same(
            "the buffer size of a file object: the same bytes reach the file",
            "xǁServerSpoolsǁwrite_body__mutmut_6",
            "xǁServerSpoolsǁwrite_body__mutmut_12",
            "xǁServerSpoolsǁadd__mutmut_29",
            "xǁ_FragmentWriterǁ__call____mutmut_19",
        ),
        **_same(
            "'utf-8' is bytes.decode's and str.encode's default, and codec names are case-insensitive",
            "xǁServerSpoolsǁread_reply__mutmut_27",
            "xǁServerSpoolsǁread_reply__mutmut_31",
            "xǁ_Chunksǁflush__mutmut_6",
        ),
        **_same(
            "the reply's decoding chunk size (iter_object's default 1 MiB instead of 256 KiB): same members "
            "and fragments, only the reader's buffer differs",
            "xǁServerSpoolsǁread_reply__mutmut_44",
        ),
        **_same(
            "the metrics writer's flush point moves by one character (a size starting at 1, or '>' for "
            "'>='): the same bytes, in chunks one character apart",
            "xǁ_Chunksǁ__init____mutmut_4",
            "xǁ_Chunksǁflush__mutmut_8",
            "xǁ_Chunksǁwrite__mutmut_4",
        ),
        **_same(_NONE_FALSE, "xǁ_FragmentWriterǁ__init____mutmut_5"),
        **_same(
            "asyncio.shield already marks the inner future's exception retrieved when the outer one is "
            "cancelled, so the explicit retrieval is redundant (tested: no 'exception was never retrieved')",
            "x_run_joined__mutmut_10",
        ),
    },
    "distributed/driver.py": {
        **_same("specs is assigned before it is read", "xǁShardDriverǁ_plan_loop__mutmut_2"),
        **_same(
            "the clock argument is stored but never read by the driver", "xǁShardDriverǁ__init____mutmut_7"
        ),
        **_same(
            "initial value replaced before any read: _cond() creates the planner task before stop_planning "
            "reads it",
            "xǁShardDriverǁ__init____mutmut_9",
        ),
        **_same(_NONE_FALSE, "xǁShardDriverǁ__init____mutmut_15"),
    },
    "dispatch/engine.py": {
        **_same(
            "the tag of a taskset / server group key only keeps it apart from agent names (strings); any "
            "tag does that",
            *(f"x__agent_key__mutmut_{n}" for n in (12, 13, 15, 16)),
        ),
        **_same(
            "every caller (dispatch, the helper, the stream worker) passes route_failures_to_sidecar and "
            "retry_requests; record_unrouted_failures is read only with routing off, and the one caller "
            "that leaves it out (the stream worker) routes",
            *(f"x_build_dispatcher__mutmut_{n}" for n in (1, 2, 3)),
        ),
        **_same(
            "unreachable: dispatch() and the helper set _dispatcher right after building the iterator "
            "(its own counters are zero / None before the first row, which a test checks)",
            *(f"xǁDispatchIteratorǁstats__mutmut_{n}" for n in range(2, 17)),
        ),
        **_same(
            "the margin's bookkeeping: _margin_at is read only once a margin was computed (which sets it), "
            "and without it the histogram margin is recomputed at the same 64-sample points to the same "
            "value",
            "xǁLatencyTrackerǁ__init____mutmut_8",
            "xǁLatencyTrackerǁ__init____mutmut_9",
            "xǁLatencyTrackerǁdrain_margin__mutmut_17",
        ),
        **_same(
            "unreachable for q in [0, 1]: the bucket counts add up to count > (count - 1) * q, so the loop "
            "returns first",
            *(f"xǁLatencyTrackerǁquantile__mutmut_{n}" for n in range(39, 47)),
        ),
        **_same(
            "the emptied exact list is only tested for truth once the histogram holds samples "
            "([] and None read alike)",
            "xǁLatencyTrackerǁrecord__mutmut_10",
        ),
        **_same(
            "the health state of a URL is created by admit(url, server), always before failed(): the "
            "server name given to failed() is not read again",
            "xǁ_Dispatcherǁ_attempt__mutmut_64",
        ),
        **_same(
            "run_outcomes (the only outcomes-shaped caller) always routes failures, so the shape test "
            "after `self.route or` is never what decides",
            "xǁ_Dispatcherǁ_failed__mutmut_6",
            "xǁ_Dispatcherǁ_failed__mutmut_7",
        ),
        **_same(
            "without ServerHealth, _attempt never returns the resend marker, so `last` is not read",
            "xǁ_Dispatcherǁ_run_row__mutmut_5",
            "xǁ_Dispatcherǁ_run_row__mutmut_8",
        ),
        **_same(
            "the route cache is a speed-up: a miss routes the row again to the same server",
            *(f"xǁ_Dispatcherǁserver_of__mutmut_{n}" for n in (7, 8, 22)),
        ),
        **_same(
            "environment_server_for_row returns the stamp itself for a stamped row (after the same check)",
            "xǁ_Dispatcherǁserver_of__mutmut_11",
        ),
        **_same(
            "the route's server is an environment server (checked first), so it is always an instance",
            "xǁ_Dispatcherǁserver_of__mutmut_20",
        ),
    },
    "_json.py": {
        **_same(
            "always json (no fast path, or orjson's text of None, which holds null and so falls back): the "
            "same bytes, only slower",
            *(f"x_dumps_compact__mutmut_{n}" for n in (1, 2, 4)),
        ),
        **_same("the codec's spelling: 'UTF-8' and 'utf-8' name the same codec", "x_dumps_compact__mutmut_8"),
        **_same("always json.loads: the same value or error, only slower", "x_loads__mutmut_4"),
        **_same(
            "the 17-zeros mark is defensive: on 6,000 random values and 20,000 floats of every magnitude "
            "no text needs it that an exponent, 0.0000 or null mark does not already send to json",
            "x_orjson_text__mutmut_16",
        ),
    },
}
