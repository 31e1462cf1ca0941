"""The `dwdp` command line.

The base install (`pip install -e .`) runs `dwdp demo`, `families`, `tune`, `tune-kernel`, `trace` (but
its timeline) and every `--help`; a subcommand that needs an extra imports it only when it runs, and
without it says which extra in one line and exits 2 before doing any work. Every one-line refusal
exits 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# The modules of each extra of pyproject.toml that a subcommand imports (a test keeps them in step).
EXTRA_MODULES = {
    "serve": ("fastapi", "uvicorn", "httpx", "prometheus_client"),
    "bench": ("matplotlib", "openai"),
}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    from dwdp.runtime.transport.registry import backend_names

    parser = argparse.ArgumentParser(prog="dwdp", description="Distributed Weight Data Parallelism for MoE serving")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a local DWDP group on a tiny model, checked against the unwrapped model")
    demo.add_argument("--ranks", type=_positive_int, default=4, help="processes in the DWDP group (default 4)")
    demo.add_argument("--prompts", type=_positive_int, default=3, help="prompts per rank (default 3)")
    demo.add_argument("--max-len", type=_positive_int, default=64, help="longest prompt in tokens (default 64)")
    demo.add_argument("--slice-bytes", type=_positive_int, default=None,
                      help="copy slice size (default: the backend's, 1 MiB on cpu, 4 MiB on cuda)")
    demo.add_argument("--repeats", type=_positive_int, default=3, help="timed forwards per rank (default 3)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--timeout", type=float, default=300.0, help="seconds before the demo gives up on a rank")
    demo.add_argument("--trace", metavar="DIR", help="write each rank's trace_rank{r}.json into DIR")
    demo.add_argument("--json", metavar="PATH", help="also write the table, the machine and its load average to PATH")
    demo.add_argument("--family", default="deepseek_v3",
                      help="MoE family of the tiny model (a transformers.models package; `dwdp families` lists them)")
    demo.add_argument("--dtype", choices=("fp32", "bf16", "fp8", "mxfp4"), default=None,
                      help="experts' weights: fp32, bf16, fp8 with 128x128 block scales, or MXFP4; checked against "
                           "the unwrapped model on the same quantized weights (default fp32 on CPU, bf16 on CUDA)")
    demo.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                      help="cpu (host backend) or cuda: rank r on cuda:(r %% GPUs), cuda backend, bf16 (default cpu)")
    families = sub.add_parser("families", help="the MoE families of the installed transformers and how dwdp wraps each")
    families.add_argument("--markdown", action="store_true", help="print the family table block of docs/models.md, markers included")
    tune = sub.add_parser("tune", help="measure copy bandwidth and layer compute here; recommend a DWDPConfig")
    source = tune.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="PATH", help="local model directory (its config.json; random weights)")
    source.add_argument("--family", help="a tiny model of this family instead of the demo model")
    tune.add_argument("--dtype", choices=("fp8", "mxfp4"),
                      help="experts quantized as fp8 (128x128 block scales) or MXFP4 (default: as the config says)")
    tune.add_argument("--group-size", type=_positive_int, default=4, help="ranks per DWDP group (default 4)")
    tune.add_argument("--max-num-tokens", type=_positive_int, default=256, help="tokens per forward (default 256)")
    tune.add_argument("--backend", choices=("auto", *backend_names()), default="auto",
                      help="transport to measure: cuda (copy engines, this node's GPUs), host, or auto: cuda when a "
                           "CUDA device is usable (default auto)")
    tune.add_argument("--slice-sizes", default=None,
                      help="comma-separated slice sizes in bytes to measure (default host: 64 KiB .. 4 MiB, "
                           "cuda: 256 KiB .. 16 MiB)")
    tune.add_argument("--copy-batches", default=None,
                      help="comma-separated batch counts per layer to measure (default host: 4, cuda: 1,2,4,8)")
    tune.add_argument("--inflight", type=_positive_int, default=2, help="copier threads (default 2)")
    tune.add_argument("--memory-gib", type=float, help="memory budget per rank (default: 80%% of available / ranks)")
    tune.add_argument("--repeats", type=_positive_int, default=3)
    tune.add_argument("--out", default="dwdp_tuned.json", help="where to write the recommended DWDPConfig")
    tune.add_argument("--report", metavar="JSON", help="also write the measurements and the reasoning here")
    kt = sub.add_parser("tune-kernel", help="sweep the Triton experts kernel's tiles for a model on this GPU and "
                        "write this device's kernel configuration file")
    shape = kt.add_mutually_exclusive_group(required=True)
    shape.add_argument("--model", metavar="PATH", help="local model directory (its config.json)")
    shape.add_argument("--preset", help="a model preset of the cost model (dwdp/predict/data/models.json)")
    shape.add_argument("--shape", metavar="H,I,E,K", help="hidden, expert intermediate, experts, experts per token")
    kt.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16",
                    help="bf16 weights, or fp8 with 128x128 block scales and fp8 x fp8 dots (default bf16)")
    kt.add_argument("--tokens", default="512,4096,16384", help="comma-separated tokens per forward to tune for")
    kt.add_argument("--full", action="store_true", help="sweep every usual tile size, warps and stages (slow)")
    kt.add_argument("--warmup", type=_positive_int, default=3)
    kt.add_argument("--repeats", type=_positive_int, default=10)
    kt.add_argument("--out-dir", help="where to write (default: DWDP_KERNEL_CONFIGS, else the package's "
                    "kernels/configs/)")
    kt.add_argument("--device", default="cuda", help="device to tune on (default cuda; cpu runs the interpreter)")
    serve = sub.add_parser("serve", help="context server: one independent prefill worker per DWDP rank, behind a "
                           "least-outstanding-tokens router (FastAPI)")
    served = serve.add_mutually_exclusive_group()
    served.add_argument("--model", metavar="PATH", help="safetensors checkpoint directory, loaded per rank")
    served.add_argument("--preset", choices=("tiny", "small"), default="tiny",
                        help="random-weight model: tiny (the demo's) or small (a Qwen3-MoE shape for GPUs); default tiny")
    serve.add_argument("--config", metavar="FILE",
                       help="a DWDPConfig JSON (what `dwdp tune --out FILE` writes) every worker starts from; the "
                       "flags below that overlap it (--ranks, --slice-bytes, --expert-replicas, --peer-timeout, "
                       "--device) override it when given, and the server says so once")
    serve.add_argument("--ranks", type=_positive_int, default=None,
                       help="worker processes / DWDP ranks (default: --config's group_size, else 2)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    serve.add_argument("--tokenizer", metavar="PATH", help="tokenizer directory for text prompts (default: --model)")
    serve.add_argument("--max-num-tokens", type=_positive_int, default=1024,
                       help="real tokens per packed forward (longer prompts are prefilled in chunks of this many); "
                       "for a family that cannot pack, padded tokens per forward and the longest prompt (default 1024)")
    serve.add_argument("--forwards", choices=("auto", "padded"), default="auto",
                       help="auto: packed forwards (no padding, long prompts in chunks) when the model's attention "
                       "packs, else padded; padded: left-padded batches always (the baseline)")
    serve.add_argument("--max-prompt-tokens", type=int, default=None,
                       help="longest prompt accepted, up to the model's max_position_embeddings (default: those, "
                       "capped by --max-queue-tokens); longer ones get 400")
    serve.add_argument("--max-queue-tokens", type=_positive_int, default=8192,
                       help="prompt tokens queued or running per worker before 429 (default 8192)")
    serve.add_argument("--max-body-bytes", type=_positive_int, default=1 << 20, help="largest request body (1 MiB)")
    serve.add_argument("--kv-dir", metavar="DIR", help="where KV artifacts go (default: a temporary directory "
                       "removed at shutdown)")
    serve.add_argument("--slice-bytes", type=_positive_int, default=None,
                       help="copy slice size (default: --config's, else the backend's, 1 MiB on cpu, 4 MiB on cuda)")
    serve.add_argument("--expert-replicas", type=_positive_int, default=None,
                       help="ranks owning every expert; 2 keeps serving every expert after losing a rank (default: "
                       "--config's, else 1)")
    serve.add_argument("--peer-timeout", type=float, default=None,
                       help="seconds a copy may take before the peer's liveness is checked (default: --config's, "
                       "else 2)")
    serve.add_argument("--stall-timeout", type=float, default=2.0,
                       help="a worker silent this long gets no new requests until it reports again (default 2)")
    serve.add_argument("--fault-injection", action="store_true",
                       help="enable POST /admin/fault {\"rank\": r}: make rank r's memory unreadable (chaos tests)")
    serve.add_argument("--restart", choices=("never", "on-failure"), default=None,
                       help="start a dead worker again as the same rank, which rejoins its group (default on-failure "
                            "in dwdp mode on the cpu, never elsewhere)")
    serve.add_argument("--restart-backoff", type=float, default=0.5,
                       help="seconds before a worker's first restart in a minute; doubles with each further (default 0.5)")
    serve.add_argument("--max-restarts-per-minute", type=_positive_int, default=3,
                       help="restarts of one worker within a minute; one more death leaves it down (default 3)")
    serve.add_argument("--threads-per-worker", type=_positive_int, default=1, help="torch threads per worker")
    serve.add_argument("--seed", type=int, default=0, help="seed of the preset model's weights")
    serve.add_argument("--drain-timeout", type=float, default=30.0, help="seconds shutdown waits for requests")
    serve.add_argument("--device", choices=("cpu", "cuda"), default=None,
                       help="cpu (host backend) or cuda: worker r on cuda:(r %% GPUs), cuda backend (default: cuda "
                       "when --config's backend is cuda, else cpu)")
    serve.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                       help="model dtype (default bf16 on cuda, fp32 on cpu)")
    serve.add_argument("--mode", choices=("dwdp", "dep"), default="dwdp",
                       help="dwdp: every rank an independent DWDP worker (default); dep: the expert-parallel "
                            "baseline, ranks stepping together (all-to-alls, idle steps)")
    serve.add_argument("--step-timeout", type=float, default=30.0,
                       help="dep: seconds a rank waits for its peers at one collective before failing the step")
    serve.add_argument("--batch-order", choices=("fifo", "shortest"), default="fifo",
                       help="which queued prompts a forward takes: arrival order (default: it won `dwdp bench serve` "
                            "on a quiet machine), or shortest first within --fairness")
    serve.add_argument("--fairness", type=float, default=0.5,
                       help="shortest: a prompt queued this many seconds goes first whatever its length (default 0.5)")
    serve.add_argument("--nnodes", type=_positive_int, default=1,
                       help="nodes the DWDP group spans, --ranks on each; run `dwdp serve` on every node with the "
                            "same flags but --node-rank (docs/multi-node.md; default 1)")
    serve.add_argument("--node-rank", type=int, default=0,
                       help="this node's index, 0..nnodes-1: it serves group ranks node-rank x ranks onwards (default 0)")
    serve.add_argument("--remote-lost-after", type=float, default=None,
                       help="seconds a worker on another node may go without a beat in the group's store before it "
                            "is declared lost (default: --config's remote_lost_after_s, else 10)")
    serve.add_argument("--dist-init-addr", metavar="HOST:PORT", default=None,
                       help="where every node's workers meet: node 0's server hosts the group's store there (no "
                            "authentication: an address only the group's nodes reach)")
    _add_front_arguments(serve)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from dwdp.benchmarks.compare import add_arguments as add_compare_arguments

    add_compare_arguments(bench_sub.add_parser("compare", help="DWDP vs DEP vs replicated on one imbalanced workload"))
    from dwdp.benchmarks.regimes import add_arguments as add_regimes_arguments

    add_regimes_arguments(bench_sub.add_parser("regimes", help="DWDP against replicated and copy-then-compute, "
                                               "from small forwards to large ones, two expert sizes"))
    from dwdp.benchmarks.serving import add_arguments as add_serve_arguments

    add_serve_arguments(bench_sub.add_parser("serve", help="DWDP serving against DEP serving: TTFT and throughput "
                                             "under open-loop Poisson load, through the openai client"))
    trace = sub.add_parser("trace", help="analyse one run's traces (trace_rank*.json, Nsight .sqlite or "
                           "torch.profiler JSON); also traces/<name>.py by path")
    from dwdp.observe.traces.commands import add_arguments as add_trace_arguments

    add_trace_arguments(trace.add_subparsers(dest="trace", required=True))
    return parser


def _add_front_arguments(serve) -> None:
    """`dwdp serve`'s router settings: the decode hand-off, KV expiry and the API key (FrontConfig)."""
    serve.add_argument("--decode-url", metavar="URL",
                       help="decode server (vLLM with dwdp's KV connector) that continues every completion from its "
                            "prefill KV: whole completions, streamed on stream=true (default: none, one token each)")
    serve.add_argument("--decode-timeout", type=float, default=600.0,
                       help="seconds to wait for the decode server's next token (default 600)")
    serve.add_argument("--kv-ttl", type=float, default=600.0,
                       help="seconds a KV artifact may wait to be loaded before it is removed; 0 keeps them until the "
                            "server stops (default 600)")
    serve.add_argument("--api-key", default=None,
                       help="clients must send `Authorization: Bearer KEY` on /v1/* and /admin/* (default: "
                            "DWDP_API_KEY, else no key); /health and /metrics stay open")
    serve.add_argument("--kv-max-pending", type=_positive_int, default=1024,
                       help="KV artifacts that may wait for a decode engine at once; more: 429 with Retry-After "
                            "(default 1024)")
    serve.add_argument("--kv-max-pending-bytes", type=int, default=None,
                       help="their bytes; more: 429 (default: half the KV directory's file system)")
    serve.add_argument("--kv-min-free-bytes", type=int, default=None,
                       help="free bytes the KV directory's file system keeps; less: 503 with Retry-After "
                            "(default: 5%% of it, at most 1 GiB)")
    serve.add_argument("--max-prompts-per-request", type=_positive_int, default=64,
                       help="prompts one completion request may carry (default 64)")
    serve.add_argument("--served-model-name", default=None,
                       help="a model name clients may ask for besides the model's own (the decode server's "
                            "served name is taken too)")


def _front_config(args):
    from dwdp import envs
    from dwdp.serve.front import FrontConfig
    from dwdp.serve.kv_handoff import kv_key

    try:
        return FrontConfig(decode_url=args.decode_url, decode_api_key=envs.decode_api_key(),
                           decode_timeout_s=args.decode_timeout, kv_ttl_s=args.kv_ttl or None,
                           api_key=args.api_key if args.api_key is not None else envs.api_key(), kv_key=kv_key(),
                           kv_max_pending=args.kv_max_pending, kv_max_pending_bytes=args.kv_max_pending_bytes,
                           kv_min_free_bytes=args.kv_min_free_bytes,
                           max_prompts_per_request=args.max_prompts_per_request,
                           served_model_name=args.served_model_name)
    except ValueError as exc:
        raise SystemExit(f"dwdp serve: {exc}") from None


def _int_list(flag: str, text: str, low: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"dwdp tune: {flag}={text!r} must be comma-separated integers") from None
    if not values or min(values) < low:
        raise SystemExit(f"dwdp tune: {flag}={text!r} must hold values >= {low}")
    return values


def extras_needed(args) -> tuple[str, ...]:
    """The extras of pyproject.toml this parsed command line imports when it runs."""
    if args.command == "serve":
        return ("serve",)
    if args.command == "bench" and args.bench == "serve":
        return ("bench",) if args.stored else ("serve", "bench")  # --from only recomputes and plots
    if args.command == "bench":
        return ("bench",)
    if args.command == "trace":
        from dwdp.observe.traces.commands import EXTRAS

        return EXTRAS.get(args.trace, ())
    return ()


def missing_extra(command: str, extras: tuple[str, ...]) -> str | None:
    """One line naming the first module of `extras` that does not import, and the install that
    brings it; None when all do."""
    for extra in extras:
        for module in EXTRA_MODULES[extra]:
            try:
                importlib.import_module(module)
            except ImportError:
                return f"{command} needs {module}: pip install -e '.[{','.join(extras)}]'"
    return None


def _model_config(command: str, path: str):
    """config.json of the local model directory `path`, or SystemExit with one line."""
    from pathlib import Path

    if not (Path(path) / "config.json").is_file():
        what = "is not a directory" if not Path(path).is_dir() else "has no config.json"
        raise SystemExit(f"{command}: --model {path} {what}: expected a local model directory with a config.json")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{command}: --model {path}: config.json does not load: {str(exc).splitlines()[0]}") from None


def _tune(args) -> int:
    import json

    from dwdp.runtime.transport.registry import auto_backend
    from dwdp.tune.recommend import copy_device, resolve_tune_backend, run_tune, tune_candidates

    if args.backend != "auto" and copy_device(args.backend) == "cuda":
        from dwdp.runtime.devices import NoGpu, require_gpu

        try:
            require_gpu("dwdp tune", flag=f"--backend {args.backend}", instead=f"--backend {auto_backend('cpu')}")
        except NoGpu as exc:
            raise SystemExit(str(exc)) from None
    if args.model:
        model_config = _model_config("dwdp tune", args.model)
    else:
        from dwdp.models.demo_model import DEMO_MODEL
        from dwdp.models.tiny import tiny_config

        model_config = tiny_config(args.family or "deepseek_v3", **({} if args.family else DEMO_MODEL))
    if args.dtype:
        from dwdp.models.demo_model import FP8_BLOCK
        from dwdp.models.quantization import ExpertsQuantization

        quant = ExpertsQuantization("fp8", FP8_BLOCK) if args.dtype == "fp8" else ExpertsQuantization(args.dtype)
        model_config.quantization_config = quant.config_dict()
    backend = resolve_tune_backend(args.backend)
    default_sizes, default_batches = tune_candidates(backend)
    sizes = _int_list("--slice-sizes", args.slice_sizes or default_sizes, 1)
    batches = _int_list("--copy-batches", args.copy_batches or default_batches, 1)
    budget = int(args.memory_gib * 2**30) if args.memory_gib else None
    result = run_tune(model_config, args.group_size, args.max_num_tokens, sizes, args.inflight, budget, args.out,
                      args.repeats, backend=backend, batch_counts=tuple(batches))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _tune_kernel(args) -> int:
    import torch

    from dwdp.tune.kernel import model_gemms, run_tune_kernel

    if args.shape:
        try:
            hidden, inter, experts, top_k = (int(v) for v in args.shape.split(","))
        except ValueError:
            raise SystemExit(f"dwdp tune-kernel: --shape={args.shape!r} must be four integers H,I,E,K") from None
        name = f"H={hidden} I={inter} E={experts} k={top_k}"
    else:
        from dwdp.predict.costmodel.models import ModelSpec, preset_config

        if args.model:
            model_config = _model_config("dwdp tune-kernel", args.model)
        else:
            try:
                model_config = preset_config(args.preset)
            except ValueError as exc:
                raise SystemExit(f"dwdp tune-kernel: --preset: {exc}") from None
        spec = ModelSpec.from_config(model_config, name=args.model or args.preset)
        hidden, inter, experts, top_k, name = spec.hidden, spec.moe_intermediate, spec.num_experts, spec.top_k, spec.name
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
        shapes = model_gemms(hidden, inter, experts, top_k, tokens, args.dtype)
    except ValueError as exc:
        raise SystemExit(f"dwdp tune-kernel: --tokens={args.tokens!r}: {exc}") from None
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("dwdp tune-kernel: no CUDA device here (--device cpu runs the Triton interpreter, whose "
                         "timings mean nothing)")
    how = (f"dwdp tune-kernel on {name} (H={hidden}, I={inter}, E={experts}, k={top_k}), {args.dtype}, tokens "
           f"{tokens}, {'full' if args.full else 'short'} candidate list, {args.warmup} warm-up + {args.repeats} timed "
           f"calls per candidate, weights in 4 buffers")
    run_tune_kernel(shapes, device, full=args.full, warmup=args.warmup, repeats=args.repeats, out_dir=args.out_dir,
                    how=how)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = " ".join(["dwdp", args.command] + ([args.bench] if args.command == "bench" else [])
                       + ([args.trace] if args.command == "trace" else []))
    line = missing_extra(command, extras_needed(args))
    if line:
        print(line, file=sys.stderr)
        return 2
    try:
        return _run(args)
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        # A one-line refusal of bad input: exit 2, as argparse does for the flags it checks itself.
        print(exc.code, file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.command == "demo":
        from dwdp.demo import run_demo

        from dwdp.models.families import family

        try:
            family(args.family)
        except ValueError as exc:
            raise SystemExit(f"dwdp demo: --{exc}") from None
        from dwdp.runtime.devices import NoGpu

        try:
            return run_demo(args.ranks, args.prompts, args.max_len, args.slice_bytes, args.repeats, args.seed,
                            args.timeout, args.trace, args.json, args.family, args.dtype, args.device)
        except NoGpu as exc:
            print(exc, file=sys.stderr)
            return 2
    if args.command == "families":
        from dwdp.runtime.coverage import TABLE_BEGIN, TABLE_END, all_families, markdown

        rows = all_families()
        if args.markdown:
            print(f"{TABLE_BEGIN}\n{markdown(rows)}\n{TABLE_END}")
        else:
            for r in rows:
                outcome = "wraps" if r.wraps else "refused" if r.built else "not built"
                print(f"{r.family:24s} {outcome:9s} {r.path if r.wraps else r.reason}")
        return 0
    if args.command == "tune":
        return _tune(args)
    if args.command == "tune-kernel":
        return _tune_kernel(args)
    if args.command == "serve":
        from dwdp.serve import ServeConfig, run_server
        from dwdp.serve.config import load_dwdp_config, override_notice

        try:
            dwdp_config = load_dwdp_config(args.config) if args.config else None
            config = ServeConfig(
                ranks=args.ranks, host=args.host, port=args.port, model=args.model, preset=args.preset, seed=args.seed,
                tokenizer=args.tokenizer, max_num_tokens=args.max_num_tokens, max_queue_tokens=args.max_queue_tokens,
                max_prompt_tokens=args.max_prompt_tokens, max_body_bytes=args.max_body_bytes, kv_dir=args.kv_dir, slice_bytes=args.slice_bytes,
                expert_replicas=args.expert_replicas, peer_timeout_s=args.peer_timeout,
                stall_timeout_s=args.stall_timeout, fault_injection=args.fault_injection,
                threads_per_worker=args.threads_per_worker, drain_timeout_s=args.drain_timeout, device=args.device,
                dtype=args.dtype, mode=args.mode, step_timeout_s=args.step_timeout, batch_order=args.batch_order,
                fairness_s=args.fairness, restart=args.restart, restart_backoff_s=args.restart_backoff,
                max_restarts_per_minute=args.max_restarts_per_minute, forwards=args.forwards, nnodes=args.nnodes,
                node_rank=args.node_rank, dist_init_addr=args.dist_init_addr,
                remote_lost_after_s=args.remote_lost_after, dwdp=dwdp_config)
        except ValueError as exc:
            raise SystemExit(f"dwdp serve: {exc}") from None
        notice = override_notice(config, args.config)
        if notice:
            print(f"dwdp serve: {notice}", flush=True)
        if config.device == "cuda":
            from dwdp.runtime.devices import NoGpu, require_gpu

            try:
                require_gpu("dwdp serve")
            except NoGpu as exc:
                print(exc, file=sys.stderr)
                return 2
        return run_server(config, _front_config(args))
    if args.command == "bench" and args.bench == "compare":
        from dwdp.benchmarks.compare import run_compare

        return run_compare(args)
    if args.command == "bench" and args.bench == "serve":
        from dwdp.benchmarks.serving import run_bench_serve

        return run_bench_serve(args)
    if args.command == "bench" and args.bench == "regimes":
        from dwdp.benchmarks.regimes import run_regimes

        return run_regimes(args)
    if args.command == "trace":
        from dwdp.observe.traces.commands import run_trace

        return run_trace(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
