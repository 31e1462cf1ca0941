"""Trace readers and analyses: hand-built Nsight SQLite and Chrome traces with hand-computed
answers, a torch.profiler CPU export, corrupt inputs, and the traces of a real 4-rank demo run."""
from __future__ import annotations

import importlib.util
import json
import sqlite3
import sys
from pathlib import Path

import pytest
import torch

from dwdp.observe import phases
from dwdp.predict.contention import contention_pmf
from dwdp.observe.traces import TraceFormatError, load_trace
from dwdp.observe.traces.breakdown import breakdown_trace, compare, summarize
from dwdp.observe.traces.bubbles import bubbles_trace, per_layer
from dwdp.observe.traces.contention import contended_waits, measure_contention, wait_episodes
from procs import run

REPO = Path(__file__).resolve().parents[1]
US = 1000  # ns per us: the Nsight database is in ns


def _script(name: str):
    """traces/<name>.py loaded as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"traces_{name}", REPO / "traces" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# Nsight Systems SQLite export, built from the documented schema
# ---------------------------------------------------------------------------------------------
NSYS_SCHEMA = """
CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL,
    contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,
    demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL, gridX INTEGER NOT NULL);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL,
    contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,
    bytes INTEGER NOT NULL, copyKind INTEGER NOT NULL, srcKind INTEGER, dstKind INTEGER,
    srcDeviceId INTEGER, dstDeviceId INTEGER);
CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, rangeId INTEGER,
    text TEXT, globalTid INTEGER, textId INTEGER, domainId INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL, eventClass INTEGER NOT NULL,
    globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL, returnValue INTEGER NOT NULL);
"""
PID = 100 << 24          # serialized GlobalId of process 100
THREAD = PID | 101        # its thread 101
COMPUTE, COPY = 7, 20     # stream ids


def build_nsys_db(path: Path) -> Path:
    """Device 0 runs one forward; devices 0-3 exchange peer copies with known overlaps.

    Device 0 (us): flash 0-100, grouped_gemm 100-300, idle 300-350 (an inbound copy runs until
    340), gemm 350-400, elementwise 400-450, nccl 450-500, D2D memcpy on the compute stream 500-520.
    Peer copies (src -> dst, us): A 1->0 250-340, B 1->2 300-400, C 1->2 320-330, G 1->3 310-315,
    D 0->1 0-100, E 0->2 50-150, F 2->1 600-700.
    """
    conn = sqlite3.connect(path)
    conn.executescript(NSYS_SCHEMA)
    conn.executemany("INSERT INTO StringIds VALUES (?, ?)", [
        (1, "flash_fwd_kernel"), (2, "grouped_gemm_kernel"), (3, "sm90_xmma_gemm_bf16bf16_bf16f32"),
        (4, "vectorized_elementwise_kernel"), (5, "ncclDevKernel_AllToAll_RING_LL"), (6, "dwdp/forward"),
        (7, "cudaLaunchKernel")])
    kernels = [(0, 100, 1), (100, 300, 2), (350, 400, 3), (400, 450, 4), (450, 500, 5)]
    for corr, (s, e, name) in enumerate(kernels, start=1):
        conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?,?,?,?,?,?,?,?,?,?)",
                     (s * US, e * US, 0, 1, COMPUTE, corr, PID, name, name, 1))
    memcpys = [  # (start, end, device, stream, corr, bytes, copyKind, src, dst)
        (500, 520, 0, COMPUTE, 6, 4096, 8, 0, 0),
        (250, 340, 0, COPY, 7, 1 << 20, 10, 1, 0),
        (300, 400, 2, COPY, None, 1 << 20, 10, 1, 2),
        (320, 330, 2, COPY, None, 1 << 18, 10, 1, 2),
        (310, 315, 3, COPY, None, 1 << 16, 10, 1, 3),
        (0, 100, 1, COPY, None, 1 << 20, 10, 0, 1),
        (50, 150, 2, COPY, None, 1 << 20, 10, 0, 2),
        (600, 700, 1, COPY, None, 1 << 20, 10, 2, 1),
    ]
    for s, e, dev, stream, corr, nbytes, kind, src, dst in memcpys:
        conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                     (s * US, e * US, dev, 1, stream, corr, PID, nbytes, kind, 2, 2, src, dst))
    # Host side: the thread launches correlation ids 1..6 at 1..6 us, inside its forward range 0-10 us;
    # the peer copy (7) is launched later, outside it.
    for corr in range(1, 8):
        t = (corr if corr < 7 else 900) * US
        conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?,?,?,?,?,?,?)", (t, t + 500, 1, THREAD, corr, 7, 0))
    conn.executemany("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, textId) VALUES (?,?,?,?,?,?)", [
        (0, 10 * US, 59, None, THREAD, 6),             # FORWARD as a registered string
        (2 * US, 3 * US, 59, "my_other_range", THREAD, None),
        (4 * US, None, 34, "a mark", THREAD, None),     # an instant, not a range
    ])
    conn.commit()
    conn.close()
    return path


def test_nsys_breakdown_matches_hand_computed(tmp_path):
    trace = load_trace(build_nsys_db(tmp_path / "run.sqlite"))
    assert trace.format == "nsys-sqlite" and sorted(trace.ranks) == [0, 1, 2, 3]
    rank0 = trace.ranks[0]
    # The host range 0-10 us maps onto the device work it launched: 0-520 us.
    assert [(w.start, w.end) for w in rank0.iterations] == [(0.0, 520.0)], rank0.iterations
    rows = [r for r in breakdown_trace(trace) if r.rank == 0]
    assert len(rows) == 1
    expected = {"Attention": 100.0, "GroupedGEMM": 200.0, "Synchronization": 40.0, "DenseGEMM": 50.0,
                "Others": 60.0, "Communication": 50.0, "D2D copy": 20.0, "P2P copy": 0.0}
    got = rows[0].categories
    assert got == pytest.approx(expected, abs=1e-9), got
    assert sum(got.values()) == pytest.approx(rows[0].dur, rel=1e-12), (sum(got.values()), rows[0].dur)
    assert rows[0].overlapped == pytest.approx({"P2P copy": 90.0}), rows[0].overlapped


def test_nsys_contention_histogram_matches_hand_computed(tmp_path):
    result = measure_contention(load_trace(build_nsys_db(tmp_path / "run.sqlite")))
    # Per copy: F alone; C, D, E see one other destination; A, B, G see two.
    assert result.copies_by_degree == {1: 1, 2: 3, 3: 3}, result.copies_by_degree
    # Pull time (us) per degree: 310 at C=1, 180 at C=2, 15 at C=3, of 505.
    assert result.time_share_by_degree == pytest.approx({1: 310 / 505, 2: 180 / 505, 3: 15 / 505}), result.time_share_by_degree
    assert result.group_size == 4
    assert list(result.expected.values()) == pytest.approx(list(contention_pmf(4)))
    assert result.per_source[1] == {2: 1, 3: 3}, result.per_source


def test_nsys_bubbles_are_idle_time_with_an_inbound_copy(tmp_path):
    rows = [r for r in bubbles_trace(load_trace(build_nsys_db(tmp_path / "run.sqlite"))) if r.rank == 0]
    assert rows[0].bubble_us == pytest.approx(40.0) and rows[0].by_layer == {None: pytest.approx(40.0)}, rows


def test_nsys_unknown_schema_names_the_missing_column(tmp_path):
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    conn.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, deviceId INTEGER, streamId INTEGER, name INTEGER)")
    conn.commit()
    conn.close()
    with pytest.raises(TraceFormatError, match=r"old\.sqlite.*CUPTI_ACTIVITY_KIND_KERNEL has no column shortName"):
        load_trace(path)


def test_nsys_database_without_activity_tables_is_refused(tmp_path):
    path = tmp_path / "other.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE something (x INTEGER)")
    conn.commit()
    conn.close()
    with pytest.raises(TraceFormatError, match=r"other\.sqlite: no table CUPTI_ACTIVITY_KIND_KERNEL.*something"):
        load_trace(path)


@pytest.mark.parametrize("content", [b"this is not a database at all", b"", "truncated"])
def test_not_sqlite_or_truncated_sqlite_gives_trace_format_error(tmp_path, content):
    path = tmp_path / "bad.sqlite"
    if content == "truncated":
        good = build_nsys_db(tmp_path / "good.sqlite").read_bytes()
        content = good[: len(good) // 3]
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match=r"bad\.sqlite"):
        load_trace(path)


# ---------------------------------------------------------------------------------------------
# Our Chrome traces, synthetic: 3 ranks with known overlaps
# ---------------------------------------------------------------------------------------------
def _x(name, ts, dur, tid=0, **args):
    return {"ph": "X", "name": name, "cat": "copy" if name == phases.COPY_SLICE else "dwdp", "pid": 0, "tid": tid,
            "ts": ts, "dur": dur, "args": args}


def _copy(start, end, src, dst, nbytes, layer, slot=0, expert=0, tid=100):
    return _x(phases.COPY_SLICE, start, end - start, tid, src=src, dst=dst, bytes=nbytes, layer=layer, slot=slot, expert=expert)


def _wait(start, end, layer, slot=0, iteration=0):
    return _x(phases.PREFETCH_WAIT, start, end - start, layer=layer, slot=slot, iteration=iteration)


def synthetic_ranks() -> dict[int, list[dict]]:
    """Events (us) of three ranks, one forward 0-1000 each.

    rank 0: attention 0-200, router 200-250, MoE l0 250-700 (issue 260-270, waits 300-400 and
      500-520), attention 700-800, MoE l1 800-950 (wait 800-805); copies l0 1->0 100-390 (1000 B),
      2->0 390-515 (500 B), l1 1->0 600-790 (800 B).
    rank 1: MoE l0 100-900 with wait 150-450; copy l0 2->1 120-440 (1500 B).
    rank 2: MoE l0 0-1000 with wait 320-321; copy l0 1->2 200-300 (1500 B).
    """
    fwd = [_x(phases.FORWARD, 0, 1000, iteration=0)]
    return {
        0: fwd + [
            _x(phases.ATTENTION, 0, 200, layer=0, iteration=0), _x(phases.ROUTER, 200, 50, layer=0, iteration=0),
            _x(phases.MOE_COMPUTE, 250, 450, layer=0, iteration=0),
            _x(phases.PREFETCH_ISSUE, 260, 10, layer=1, slot=1, iteration=0),
            _wait(300, 400, 0), _wait(500, 520, 0),
            _x(phases.ATTENTION, 700, 100, layer=1, iteration=0), _x(phases.MOE_COMPUTE, 800, 150, layer=1, iteration=0),
            _wait(800, 805, 1, slot=1),
            _copy(100, 390, 1, 0, 1000, 0), _copy(390, 515, 2, 0, 500, 0, tid=101), _copy(600, 790, 1, 0, 800, 1, slot=1),
        ],
        1: fwd + [_x(phases.MOE_COMPUTE, 100, 800, layer=0, iteration=0), _wait(150, 450, 0),
                  _copy(120, 440, 2, 1, 1500, 0)],
        2: fwd + [_x(phases.MOE_COMPUTE, 0, 1000, layer=0, iteration=0), _wait(320, 321, 0),
                  _copy(200, 300, 1, 2, 1500, 0)],
    }


def write_chrome_run(directory: Path, ranks: dict[int, list[dict]], group_size: int | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for rank, events in ranks.items():
        meta = [{"ph": "M", "name": "thread_name", "pid": rank, "tid": 100, "args": {"name": "copier 0"}}]
        doc = {"traceEvents": meta + [{**e, "pid": rank} for e in events], "displayTimeUnit": "ms",
               "otherData": {"rank": rank, "group_size": group_size or len(ranks), "num_moe_layers": 2,
                             "plan_bytes_per_layer": {"0": 1500, "1": 800 if rank == 0 else 0}}}
        (directory / f"trace_rank{rank}.json").write_text(json.dumps(doc))
    return directory


def test_chrome_breakdown_tiles_the_forward(tmp_path):
    trace = load_trace(write_chrome_run(tmp_path / "run", synthetic_ranks()))
    assert trace.format == "dwdp-chrome" and trace.group_size == 3
    assert trace.plan_bytes[0] == {0: 1500, 1: 800}
    row = next(r for r in breakdown_trace(trace) if r.rank == 0)
    # GroupedGEMM = MoE compute minus its waits: (450 - 120) + (150 - 5).
    expected = {"Synchronization": 125.0, "Attention": 300.0, "GroupedGEMM": 475.0, "Others": 100.0,
                "DenseGEMM": 0.0, "Communication": 0.0, "D2D copy": 0.0, "P2P copy": 0.0}
    assert row.categories == pytest.approx(expected), row.categories
    assert row.overlapped == pytest.approx({"P2P copy": 290 + 125 + 190}), row.overlapped


def test_chrome_contention_histogram_and_flagged_layers(tmp_path):
    trace = load_trace(write_chrome_run(tmp_path / "run", synthetic_ranks()))
    result = measure_contention(trace)
    assert result.copies_by_degree == {1: 1, 2: 4}, result.copies_by_degree
    assert result.time_share_by_degree == pytest.approx({1: 725 / 1025, 2: 300 / 1025}), result.time_share_by_degree
    assert result.expected == pytest.approx({1: 0.5, 2: 0.5}), result.expected
    flagged = contended_waits(trace, threshold_us=50.0)
    got = sorted((f.episode.rank, f.episode.layer, f.episode.wait_us, {s: sorted(d) for s, d in f.sources.items()})
                 for f in flagged)
    assert got == [(0, 0, pytest.approx(120.0), {1: [2], 2: [1]}), (1, 0, pytest.approx(300.0), {2: [0]})], got


def test_chrome_episodes_collect_each_layers_copies(tmp_path):
    trace = load_trace(write_chrome_run(tmp_path / "run", synthetic_ranks()))
    got = {(e.rank, e.layer): e.nbytes for e in wait_episodes(trace)}
    assert got == {(0, 0): 1500, (0, 1): 800, (1, 0): 1500, (2, 0): 1500}, got


def test_chrome_bubbles_per_iteration_and_layer(tmp_path):
    rows = bubbles_trace(load_trace(write_chrome_run(tmp_path / "run", synthetic_ranks())))
    assert [(r.rank, r.bubble_us) for r in rows] == [(0, pytest.approx(125.0)), (1, pytest.approx(300.0)),
                                                     (2, pytest.approx(1.0))], rows
    assert rows[0].by_layer == pytest.approx({0: 120.0, 1: 5.0}), rows[0].by_layer
    layers = {x.layer: x for x in per_layer(rows)}
    assert layers[0].mean_us == pytest.approx(421 / 3) and layers[0].max_us == pytest.approx(300.0)
    assert layers[1].mean_us == pytest.approx(5 / 3), layers


def test_compare_normalises_delta_to_first_run_iteration(tmp_path):
    base = load_trace(write_chrome_run(tmp_path / "a", synthetic_ranks()))
    slower = synthetic_ranks()
    slower[0][0] = _x(phases.FORWARD, 0, 1200, iteration=0)  # +200 us of Others on rank 0
    other = load_trace(write_chrome_run(tmp_path / "b", slower))
    a = summarize([r for r in breakdown_trace(base) if r.rank == 0])
    b = summarize([r for r in breakdown_trace(other) if r.rank == 0])
    delta = compare(a, b)
    assert delta["Others"] == pytest.approx(0.2) and delta["Iteration"] == pytest.approx(0.2), delta
    assert delta["Attention"] == pytest.approx(0.0), delta


def test_scripts_print_tables_and_write_json(tmp_path, capsys):
    run = write_chrome_run(tmp_path / "run", synthetic_ranks())
    for name in ("breakdown", "contention", "bubbles", "timeline"):
        out = tmp_path / f"{name}.json"
        extra = ["-o", str(tmp_path / "t.png")] if name == "timeline" else []
        assert _script(name).main([str(run), "--json", str(out)] + extra) == 0, name
        assert json.loads(out.read_text()), name
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "GroupedGEMM" in printed and "random-pull P(C)" in printed and "bubble ms" in printed, printed
    doc = json.loads((tmp_path / "contention.json").read_text())
    assert doc["contention"]["copies_by_degree"] == {"1": 1, "2": 4}, doc


# ---------------------------------------------------------------------------------------------
# torch.profiler
# ---------------------------------------------------------------------------------------------
def test_torch_profiler_cpu_trace_parses(tmp_path):
    from torch.profiler import ProfilerActivity, profile, record_function

    linear = torch.nn.Linear(64, 64)
    x = torch.randn(1, 2, 16, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
        for _ in range(2):
            with record_function(phases.FORWARD):
                torch.nn.functional.scaled_dot_product_attention(x, x, x)
                linear(x)
    path = tmp_path / "torch_rank3.json"
    prof.export_chrome_trace(str(path))
    trace = load_trace(path)
    assert trace.format == "torch-profiler" and list(trace.ranks) == [3]
    rank = trace.ranks[3]
    assert len(rank.iterations) == 2 and rank.kernels, rank.iterations
    for row in breakdown_trace(trace):
        assert sum(row.categories.values()) == pytest.approx(row.dur, rel=1e-9), row
        assert row.categories["Attention"] > 0 and row.categories["DenseGEMM"] > 0, row.categories


# ---------------------------------------------------------------------------------------------
# Corrupt inputs
# ---------------------------------------------------------------------------------------------
def _good_doc() -> dict:
    return {"traceEvents": [_x(phases.FORWARD, 0, 10, iteration=0)], "otherData": {"rank": 0}}


@pytest.mark.parametrize("mutate, message", [
    (lambda text: text[: len(text) // 2], "not valid JSON"),
    (lambda text: "", "empty file"),
    (lambda text: json.dumps({"events": []}), "no 'traceEvents' list"),
    (lambda text: json.dumps({"traceEvents": [{"ph": "X", "name": phases.FORWARD, "ts": 0}]}), "no valid 'dur'"),
    (lambda text: json.dumps({"traceEvents": [_x(phases.FORWARD, 0, -5)], "otherData": {"rank": 0}}), "dur=-5"),
    (lambda text: json.dumps({"traceEvents": [_x(phases.COPY_SLICE, 0, 5, 100, dst=0, bytes=4)], "otherData": {"rank": 0}}),
     "no integer args.src"),
    (lambda text: json.dumps({"traceEvents": [_x("something_else", 0, 5)], "otherData": {"rank": 0}}), "no dwdp phase"),
    (lambda text: json.dumps({**json.loads(text), "otherData": {"rank": 0, "plan_bytes_per_layer": {"0": "x"}}}),
     "plan_bytes_per_layer"),
])
def test_corrupt_chrome_trace_gives_trace_format_error(tmp_path, mutate, message):
    path = tmp_path / "trace_rank0.json"
    path.write_text(mutate(json.dumps(_good_doc())))
    with pytest.raises(TraceFormatError, match="trace_rank0.json") as info:
        load_trace(tmp_path)
    assert message in str(info.value), str(info.value)


def test_missing_inputs_and_script_exit_code(tmp_path, capsys):
    with pytest.raises(TraceFormatError, match="no such file"):
        load_trace(tmp_path / "nope.sqlite")
    with pytest.raises(TraceFormatError, match="expected trace_rank"):
        load_trace(tmp_path)
    (tmp_path / "trace_rank0.json").write_text("{\"traceEvents\": [")
    assert _script("breakdown").main([str(tmp_path)]) == 2
    assert "trace_rank0.json: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["breakdown", "contention", "bubbles", "timeline"])
def test_each_trace_driver_refuses_a_trace_it_cannot_read_in_one_line(tmp_path, capsys, name):
    """`dwdp trace <name>` and traces/<name>.py: exit 2, one line naming the file, no traceback."""
    from dwdp.cli import main

    (tmp_path / "trace_rank0.json").write_text("{\"traceEvents\": [")
    assert main(["trace", name, str(tmp_path)]) == 2
    assert _script(name).main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("error: ") and "trace_rank0.json: not valid JSON" in e for e in err), err


# ---------------------------------------------------------------------------------------------
# A real 4-rank demo run
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_traces(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo_traces")
    cmd = [sys.executable, "-m", "dwdp", "demo", "--ranks", "4", "--trace", str(out), "--prompts", "1",
           "--max-len", "16", "--repeats", "1"]
    proc = run(cmd, timeout=170, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_demo_traces_have_every_layers_wait_and_planned_bytes(demo_traces):
    trace = load_trace(demo_traces)
    assert sorted(trace.ranks) == [0, 1, 2, 3] and trace.group_size == 4
    layers = range(trace.num_moe_layers)
    episodes = wait_episodes(trace)
    for rank, r in trace.ranks.items():
        iterations = [w.args["iteration"] for w in r.iterations]
        assert iterations, f"rank {rank} recorded no forward"
        for iteration in iterations:
            for layer in layers:
                mine = [e for e in episodes if (e.rank, e.iteration, e.layer) == (rank, iteration, layer)]
                assert len(mine) == 1, f"rank {rank} iteration {iteration} layer {layer}: {len(mine)} wait episodes"
                planned = trace.plan_bytes[rank][layer]
                assert mine[0].nbytes == planned, (rank, iteration, layer, mine[0].nbytes, planned)
                assert all(c.src != rank for c in mine[0].copies), mine[0].copies


def test_demo_breakdown_sums_to_iteration(demo_traces):
    rows = breakdown_trace(load_trace(demo_traces))
    assert len(rows) >= 4
    for row in rows:
        assert abs(sum(row.categories.values()) - row.dur) <= 0.01 * row.dur, (row.rank, row.categories, row.dur)
        assert row.categories["GroupedGEMM"] > 0 and row.categories["Attention"] > 0, row.categories
    result = measure_contention(load_trace(demo_traces))
    assert sum(result.copies_by_degree.values()) > 0 and max(result.copies_by_degree) <= 3, result.copies_by_degree


def test_demo_scripts_run(demo_traces, tmp_path):
    for name in ("breakdown", "contention", "bubbles", "timeline"):
        extra = ["-o", str(tmp_path / "t.png")] if name == "timeline" else []
        assert _script(name).main([str(demo_traces), "--json", str(tmp_path / f"{name}.json")] + extra) == 0, name
    assert (tmp_path / "t.png").stat().st_size > 10_000


# ---------------------------------------------------------------------------------------------
# The stored demo run quoted in traces/README.md
# ---------------------------------------------------------------------------------------------
STORED = REPO / "traces" / "results" / "demo_cpu"


def _without_source(doc):
    """The JSON minus its "source" fields (the path the script was given)."""
    if isinstance(doc, dict):
        return {k: _without_source(v) for k, v in doc.items() if k != "source"}
    if isinstance(doc, list):
        return [_without_source(v) for v in doc]
    return doc


@pytest.mark.parametrize("name, args", [("breakdown", ["--skip", "1"]), ("contention", []), ("bubbles", ["--skip", "1"])])
def test_stored_demo_outputs_are_what_the_scripts_print_for_the_stored_traces(tmp_path, name, args):
    out = tmp_path / f"{name}.json"
    assert _script(name).main([str(STORED)] + args + ["--json", str(out)]) == 0, name
    got, stored = json.loads(out.read_text()), json.loads((STORED / f"{name}.json").read_text())
    assert _without_source(got) == _without_source(stored), f"{name}: stored JSON differs from a re-run on the traces"
