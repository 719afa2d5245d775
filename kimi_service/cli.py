"""Command line: `kimi-service <command>`. Parses arguments and calls one function per command."""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kimi_service import __version__
from kimi_service.config import WORKLOADS
from kimi_service.errors import KimiError, UsageError

SIGPIPE_EXIT_STATUS = 128 + signal.SIGPIPE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kimi-service",
        description="Plan, run, check and monitor a vLLM endpoint on NVIDIA GPU hosts.",
    )
    parser.add_argument("--version", action="version", version=f"kimi-service {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_plan(commands)
    _add_bench(commands)
    _add_serve(commands)
    _add_tune(commands)
    _add_health(commands)
    _add_smoke(commands)
    _add_ctl(commands)
    _add_exporter(commands)
    _add_fetch(commands)
    _add_gpus(commands)
    return parser


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _request_shape(text: str):
    from kimi_service.tuned import Shape

    try:
        return Shape.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _float_list(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _env_file_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env-file", type=Path, metavar="FILE",
                        help="systemd environment file to read VLLM_API_KEY from when the environment lacks it "
                        "(default: secrets.env beside --config when this user can read it, as root on a "
                        "deployed host; keeps the key out of argv and Ansible's -vvv)")


def _secret(args: argparse.Namespace, name: str) -> str | None:
    """A secret from the environment, else from --env-file, else from the secrets.env the roles write beside
    the config (readable by root only: for anyone else the key must come from the environment); never from
    an argument."""
    from kimi_service.credentials import read_secret

    env_file = getattr(args, "env_file", None)
    config = getattr(args, "config", None)
    if env_file is None and config is not None:
        beside = Path(config).parent / "secrets.env"
        if beside.is_file() and os.access(beside, os.R_OK):
            env_file = beside
    return read_secret(name, env_file=env_file)


def _add_plan(commands) -> None:
    plan = commands.add_parser(
        "plan", help="will the model fit? tuned vLLM flags, or what would fit (exit 0 fits, 3 no, 2 bad input)",
        description="Plan vLLM for a model on given GPUs without touching them: tensor/pipeline parallel sizes, "
        "context length, memory budget and the reason for every flag.",
    )
    plan.add_argument("--model", required=True, metavar="DIR_OR_REPO_ID",
                      help="a model directory with config.json, or a catalog repo id (e.g. moonshotai/Kimi-K2.5)")
    plan.add_argument("--gpus", required=True, metavar="SPEC",
                      help="NAME:COUNT, COUNTxNAME or NAME:COUNT:MEMORY (A100-SXM4-80GB:4, 8xH200, L40S:2:48GiB); "
                      "cpu[:MEMORY] for the CPU engine")
    plan.add_argument("--nodes", type=int, default=1, help="nodes with SPEC GPUs each (default 1)")
    plan.add_argument("--max-model-len", type=int, metavar="N", help="context length to plan for")
    plan.add_argument("--workload", default="chat", help=", ".join(WORKLOADS))
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from kimi_service import hardware, model, planner

    gpus = hardware.parse_gpu_spec(args.gpus)
    spec = model.inspect_model(args.model)
    try:
        result = planner.plan(
            spec, gpus, nodes=args.nodes, workload=args.workload, max_model_len=args.max_model_len
        )
    except planner.DoesNotFit as exc:
        if args.json:
            print(json.dumps({"fits": False, "error": str(exc), "needed_bytes": exc.needed_bytes,
                              "available_bytes": exc.available_bytes, "suggestions": exc.suggestions}, indent=2))
        raise
    print(json.dumps(result.to_json(), indent=2) if args.json else planner.render(result))
    return 0


def _add_gpus(commands) -> None:
    # Ansible's preflight names the boards of a host without a driver from the PCI ids listed here.
    gpus = commands.add_parser("gpus", help="the GPUs the planner knows: names, aliases, PCI device ids, memory")
    gpus.add_argument("--json", action="store_true", help="print the table as JSON")
    gpus.set_defaults(handler=_run_gpus)


def _run_gpus(args: argparse.Namespace) -> int:
    from kimi_service import hardware

    table = hardware.gpu_table()
    if args.json:
        print(json.dumps({"gpus": table}))
        return 0
    for gpu in table:
        print(f"{gpu['name']:<16} {gpu['memory_mib']:>7} MiB  cc {gpu['compute_capability']:<5} "
              f"pci {','.join(gpu['pci_ids']) or '-':<14} aliases {', '.join(gpu['aliases']) or '-'}")
    return 0


def _add_bench(commands) -> None:
    bench = commands.add_parser(
        "bench", help="concurrency sweep against an OpenAI-compatible endpoint",
        description="Measure TTFT, inter-token latency, end-to-end latency, throughput and goodput "
        "at each concurrency level against an OpenAI-compatible streaming endpoint.",
    )
    bench.add_argument("--url", default="http://127.0.0.1:8000", help="endpoint base URL")
    bench.add_argument("--model", required=True, help="served model name")
    bench.add_argument("--api-key-env", metavar="VAR", default="VLLM_API_KEY",
                       help="environment variable holding the API key (default VLLM_API_KEY)")
    _env_file_arg(bench)
    bench.add_argument("--concurrency", type=_int_list, default=[1, 4, 16, 64],
                       help="closed-loop levels: that many clients each, e.g. 1,4,16,64")
    bench.add_argument("--request-rate", type=_float_list, default=[], metavar="RATES",
                       help="open-loop levels instead: Poisson arrivals at each rate in requests/s, e.g. 1,2,4 "
                       "(--prompts requests per level, sent whether or not earlier ones finished)")
    bench.add_argument("--input-len", type=int, default=512, help="prompt tokens per request")
    bench.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    bench.add_argument("--prompts", type=int, default=64, help="requests per concurrency level")
    bench.add_argument("--shared-prefix-len", type=int, default=0,
                       help="tokens of one system prompt shared by every request")
    bench.add_argument("--api", choices=["chat", "completions"], default="chat")
    bench.add_argument("--slo", help="goodput objectives, e.g. ttft=2,itl=0.1 (seconds)")
    bench.add_argument("--tokenizer", help="tokenizer directory (default: the model's directory)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", dest="json_path", type=Path, metavar="FILE", help="write results as JSON")
    bench.add_argument("--plot", type=Path, metavar="FILE.png", help="write a PNG plot")
    bench.set_defaults(handler=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from kimi_service import bench

    settings = bench.BenchSettings(
        url=args.url, model=args.model, api_key=_secret(args, args.api_key_env),
        api_key_env=args.api_key_env, concurrency=args.concurrency, input_len=args.input_len,
        output_len=args.output_len, prompts=args.prompts, shared_prefix_len=args.shared_prefix_len, api=args.api,
        slo=bench.Slo.parse(args.slo), tokenizer=args.tokenizer, seed=args.seed, request_rates=args.request_rate,
    )
    report = bench.run_bench(settings)
    print(bench.format_table(report))
    if args.json_path:
        args.json_path.write_text(json.dumps(report.to_json(), indent=2))
    if args.plot:
        bench.write_plot(report, args.plot)
    return 1 if any(level.errors for level in report.levels) else 0


def _log_to_journal() -> None:
    import logging

    # systemd's journal adds the time and unit; keep lines short.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # httpx logs every request at INFO: the supervisor's probes (and a leader's probes of its followers),
    # every few seconds, would bury the engine's own lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=Path("/etc/kimi-service/config.yaml"),
                        help="config file (default /etc/kimi-service/config.yaml)")


def _add_serve(commands) -> None:
    serve = commands.add_parser("serve", help="plan and run vLLM under systemd (Type=notify) or supervisord",
                                description="Plan from the hardware and model, run the vLLM OpenAI "
                                "server, report readiness and watchdog pings to systemd; without systemd's "
                                "watchdog, watch the engine itself (serve.watchdog_sec).")
    _config_arg(serve)
    serve.add_argument("--env-file", type=Path, metavar="FILE",
                       help="systemd EnvironmentFile to read first (VLLM_API_KEY, HF_TOKEN ...): its variables "
                       "reach the engine's environment as EnvironmentFile= would set them")
    serve.add_argument("--user", metavar="NAME",
                       help="started as root: become NAME after reading --env-file, before planning or "
                       "starting anything (not root: only the current user is accepted)")
    serve.add_argument("--check", action="store_true",
                       help="validate the config, inspect the model and plan, print the command; start nothing")
    serve.set_defaults(handler=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from kimi_service import config, launcher
    from kimi_service.launcher import identity

    if not args.check:
        _log_to_journal()
    loaded = config.load_config(args.config)
    if args.env_file:
        identity.load_env_file(args.env_file)
    if args.user:
        identity.become_user(args.user, own_dirs=[loaded.paths.plan_file.parent, loaded.paths.state_dir])
    if args.check:
        launch = launcher.prepare(loaded)
        plan = launch.plan_document
        print(f"{args.config}: valid; engine {plan.get('engine')}, {plan.get('parallelism')}, "
              f"max_model_len {plan.get('max_model_len')}, KV cache {plan.get('kv_cache_tokens'):,} tokens")
        for warning in plan.get("warnings") or []:
            print(f"warning: {warning}")
        print("would run: " + " ".join(launch.argv))
        if plan.get("extra_env"):
            print("with plan.extra_env: " + ", ".join(plan["extra_env"]))
        return 0
    return launcher.serve(loaded)


def _add_tune(commands) -> None:
    tune = commands.add_parser(
        "tune", help="measure speed flags on this host and keep only what beats the plan",
        description="Start the engine once per candidate flag set (the service must be stopped: the GPU and "
        "the API port are needed), sweep each with the workload, and write the winner to STATE_DIR/tuned.json, "
        "which serve applies. A candidate below 0.98x the plan's tokens/s or goodput at any concurrency is "
        "never applied. Measurements are kept as they finish: a second run resumes.",
    )
    _config_arg(tune)
    tune.add_argument("--env-file", type=Path, metavar="FILE",
                      help="secrets.env to read first (VLLM_API_KEY, HF_TOKEN), as serve does")
    tune.add_argument("--user", metavar="NAME", help="started as root: become NAME after reading --env-file")
    tune.add_argument("--budget", default="20m", help="time for all candidates, e.g. 20m, 1h (default 20m)")
    tune.add_argument("--concurrency", type=_int_list, default=[1, 16, 64], help="closed-loop levels (1,16,64)")
    tune.add_argument("--input-len", type=int, default=512, help="prompt tokens per request (512)")
    tune.add_argument("--output-len", type=int, default=128, help="output tokens per request (128)")
    tune.add_argument("--prompts", type=int, default=32, help="requests per level, at least the level (32)")
    tune.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of one shared system prompt")
    tune.add_argument("--also-shape", action="append", default=[], type=_request_shape, metavar="IN/OUT[+PREFIX]",
                      help="another request shape the winner must serve too, e.g. 8192/256 or 512/128+2000 "
                           "(repeatable): every engine start is swept with each, and a loss on any loses")
    tune.add_argument("--slo", default="ttft=1,itl=0.1", help="goodput objectives (default ttft=1,itl=0.1)")
    tune.add_argument("--candidate", action="append", default=[], metavar="FLAGS",
                      help="measure this flag set instead of the automatic ones (repeat for more), "
                      "e.g. --candidate '--max-num-seqs 64'")
    tune.add_argument("--status", action="store_true",
                      help="measure nothing: exit 0 when tuned.json holds for this configuration and workload, "
                      "3 when tuning would measure")
    tune.set_defaults(handler=_run_tune)


def _run_tune(args: argparse.Namespace) -> int:
    from kimi_service import bench, config, tune
    from kimi_service.launcher import identity

    loaded = config.load_config(args.config)
    if args.env_file:
        identity.load_env_file(args.env_file)
    if args.user:
        identity.become_user(args.user, own_dirs=[loaded.paths.state_dir])
    workload = tune.Workload(concurrency=tuple(args.concurrency), input_len=args.input_len,
                             output_len=args.output_len, prompts=args.prompts,
                             shared_prefix_len=args.shared_prefix_len, slo=bench.Slo.parse(args.slo),
                             more_shapes=tuple(args.also_shape))
    for shape in workload.shapes:
        bench.BenchSettings(url="", model="", concurrency=list(workload.concurrency), input_len=shape.input_len,
                            output_len=shape.output_len, prompts=workload.prompts,
                            shared_prefix_len=shape.shared_prefix_len).validate()
    session = tune.Session(loaded, workload, tune.parse_duration(args.budget), args.candidate)
    if args.status:
        why = session.stale()
        print(why or f"{session.tuned_path}: current for this configuration and workload")
        return 3 if why else 0
    outcome = session.run(api_key=_secret(args, "VLLM_API_KEY"))
    print(tune.format_table(outcome))
    print(f"applied: {' '.join(outcome.winner.candidate.flags) or 'the plan alone (nothing beat it)'}; "
          f"written to {session.tuned_path}; restart the engine to serve with it")
    return 0


def _add_health(commands) -> None:
    check = commands.add_parser("health", help="check the endpoint and GPUs (exit 0 ok, 1 degraded, 2 down)")
    _config_arg(check)
    check.add_argument("--url", help="API base URL (default: from the config, else http://127.0.0.1:8000)")
    check.add_argument("--model", help="served model name that must be listed (default: from the config)")
    check.add_argument("--json", action="store_true", help="print every check as JSON")
    check.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                       help="retry until healthy or this many seconds pass")
    check.add_argument("--no-smoke", action="store_true", help="skip the smoke chat completion")
    check.add_argument("--no-gpu", action="store_true", help="skip the NVML checks")
    check.add_argument("--every", type=float, metavar="SECONDS",
                       help="loop: check every SECONDS forever, one log line per result (what kimi-health.timer "
                       "does under systemd, for supervisord); stops on SIGTERM with exit 0")
    _env_file_arg(check)
    check.set_defaults(handler=_run_health)


def _run_health(args: argparse.Namespace) -> int:
    from kimi_service import config, health
    from kimi_service.credentials import API_KEY_VAR

    cfg = config.load_config(args.config) if args.config.exists() or not args.url else None
    target = health.Target(
        url=(args.url or cfg.api.local_url).rstrip("/"),
        served_name=args.model or (cfg.model.served_name if cfg else None),
        api_key=_secret(args, API_KEY_VAR),
        timeout=cfg.health.timeout if cfg else 10.0,
        smoke=not args.no_smoke and (cfg.health.smoke if cfg else True),
        smoke_max_tokens=cfg.health.smoke_max_tokens if cfg else 4,
        follower=bool(cfg and cfg.cluster and not cfg.cluster.is_leader and not args.url),
    )
    options = {"gpus": not args.no_gpu, "expect_gpus": bool(cfg and cfg.plan.engine == "cuda")}
    if args.every is not None:
        if args.every <= 0:
            raise UsageError(f"--every {args.every}: give a number of seconds > 0")
        return _health_every(target, args, options)
    report = health.wait_for_health(target, args.wait, **options)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.to_text())
    return report.exit_code


def _health_every(target, args: argparse.Namespace, options: dict) -> int:
    """One check every --every seconds until SIGTERM; each result one line, time-stamped (supervisord's
    log files carry no time of their own)."""
    import logging
    import signal
    import threading

    from kimi_service import health

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout, force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set():
        started = time.monotonic()
        report = health.wait_for_health(target, args.wait, **options)
        line = json.dumps({"time": time.time(), **report.to_json()}) if args.json else report.to_line()
        logging.getLogger("kimi_service.health").info("%s", line)
        stop.wait(max(0.0, args.every - (time.monotonic() - started)))
    return 0


def _add_smoke(commands) -> None:
    smoke = commands.add_parser("smoke", help="one chat completion, the key from the env file (exit 0 ok, 1 failed)",
                                description="Send one chat completion the way a client would, with VLLM_API_KEY "
                                "from the environment or --env-file (never from argv), and report its latency "
                                "and the start of the reply.")
    smoke.add_argument("--url", default="http://127.0.0.1:8000", help="API base URL (default http://127.0.0.1:8000)")
    _env_file_arg(smoke)
    smoke.add_argument("--model", help="served model name (default: the first /v1/models lists)")
    smoke.add_argument("--max-tokens", type=int, default=8, help="tokens to ask for (default 8)")
    smoke.add_argument("--timeout", type=float, default=60.0, help="seconds the completion may take (default 60)")
    smoke.add_argument("--json", action="store_true", help="print the result as JSON")
    smoke.set_defaults(handler=_run_smoke)


def _run_smoke(args: argparse.Namespace) -> int:
    import httpx

    from kimi_service import health
    from kimi_service.credentials import API_KEY_VAR

    target = health.Target(url=args.url.rstrip("/"), served_name=args.model, api_key=_secret(args, API_KEY_VAR),
                           timeout=args.timeout, smoke_max_tokens=args.max_tokens)
    with httpx.Client() as client:
        model = args.model or health.served_model(client, target)
        if model is None:
            result = health.SmokeResult(False, target.url, "", None, None, None, None,
                                        f"{target.url}/v1/models named no model (unreachable, or a wrong key); "
                                        "pass --model")
        else:
            result = health.smoke_completion(client, target, model)
    print(json.dumps(result.to_json()) if args.json else result.to_text())
    return 0 if result.ok else 1


def _add_ctl(commands) -> None:
    from kimi_service import ctl

    control = commands.add_parser(
        "ctl", help="start, stop, restart or show the services under systemd or supervisord",
        description="The same verbs on either service manager: systemctl where systemd runs the host, "
        "supervisorctl otherwise. start/restart of kimi-vllm waits for serve's /ready and, when the start "
        "fails, prints the engine's own first error and where the log is. status exits 0 when all run, 3 not.")
    control.add_argument("action", choices=["start", "stop", "restart", "status"])
    control.add_argument("programs", nargs="*", metavar="PROGRAM",
                         help=f"any of {', '.join(ctl.PROGRAMS)} (default: all three)")
    _config_arg(control)
    control.add_argument("--wait", type=float, metavar="SECONDS",
                         help="how long a start of kimi-vllm waits for /ready (default serve.startup_timeout; 0: "
                         "do not wait)")
    control.add_argument("--manager", choices=["auto", "systemd", "supervisord"], default="auto",
                         help="service manager (default auto: systemd when /run/systemd/system exists)")
    control.add_argument("--supervisor-conf", type=Path, default=ctl.DEFAULT_SUPERVISOR_CONF,
                         help=f"supervisord's config (default {ctl.DEFAULT_SUPERVISOR_CONF})")
    control.set_defaults(handler=_run_ctl)


def _run_ctl(args: argparse.Namespace) -> int:
    from kimi_service import config, ctl

    unknown = [p for p in args.programs if p not in ctl.PROGRAMS]
    if unknown:
        raise UsageError(f"ctl: unknown program {', '.join(unknown)}; choose from {', '.join(ctl.PROGRAMS)}")
    programs = list(dict.fromkeys(args.programs)) or list(ctl.PROGRAMS)
    loaded = config.load_config(args.config) if args.action != "status" and args.config.exists() else None
    manager = ctl.choose_manager(args.manager, args.supervisor_conf)
    return ctl.control(args.action, programs, manager, loaded, args.wait)


def _add_exporter(commands) -> None:
    exporter = commands.add_parser("exporter", help="Prometheus exporter: GPU (dcgm names), health, plan")
    _config_arg(exporter)
    exporter.add_argument("--port", type=int, help="listen port (default: exporter.port of the config, 9400)")
    exporter.add_argument("--host", help="listen address (default: exporter.host of the config)")
    exporter.set_defaults(handler=_run_exporter)


def _run_exporter(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from kimi_service import config, exporter, health
    from kimi_service.credentials import read_secret

    _log_to_journal()
    if not args.config.exists():
        # Like dcgm-exporter: GPU metrics need no engine, before the service is set up or without it.
        logging.getLogger("kimi_service.exporter").warning(
            "no %s: serving the GPU and NVML series only; the engine's health and plan series appear once the "
            "vllm_service role has written it", args.config)
        listen = config.ExporterConfig()
        collector = exporter.KimiCollector(nvml_module=None, plan_file=None, poller=None)
        poller = None
    else:
        cfg = config.load_config(args.config)
        target = health.Target(url=cfg.api.local_url, served_name=cfg.model.served_name,
                               api_key=read_secret(), timeout=cfg.health.timeout,
                               smoke=cfg.health.smoke, smoke_max_tokens=cfg.health.smoke_max_tokens,
                               follower=bool(cfg.cluster and not cfg.cluster.is_leader))
        listen = cfg.exporter
        poller = exporter.HealthPoller(target, cfg.exporter.health_interval)
        collector = exporter.KimiCollector(nvml_module=None, plan_file=cfg.paths.plan_file, poller=poller)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    exporter.serve_exporter(collector, poller, args.host or listen.host, args.port or listen.port, stop)
    return 0


def _add_fetch(commands) -> None:
    fetch = commands.add_parser(
        "fetch", help="download model weights resumably and verify them (hub, ModelScope, mirror, local)",
        description="List the repository's files, check free space, download what is missing (resuming "
        "partial files), verify sizes (and sha256 with --verify full; a published hash is always checked "
        "for what this run downloads) and write a marker, so a rerun "
        "is a no-op. A hub token is read from HF_TOKEN (MODELSCOPE_API_TOKEN) or --token-file, never "
        "from arguments.",
    )
    fetch.add_argument("--repo", help="repository id, e.g. moonshotai/Kimi-K2.5 (needed for all but --write-manifest)")
    fetch.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    fetch.add_argument("--dest", type=Path, required=True, help="model directory to fill")
    fetch.add_argument("--source", choices=["hf", "modelscope", "http", "local"], default="hf")
    fetch.add_argument("--endpoint", default="",
                       help="hub or mirror base URL (default https://huggingface.co, https://www.modelscope.cn)")
    fetch.add_argument("--manifest-url", default="", help="http source: manifest URL (default ENDPOINT/"
                       "kimi-manifest.json)")
    fetch.add_argument("--local-path", type=Path, help="local source: directory holding the files")
    fetch.add_argument("--verify", choices=["size", "full"], default="size",
                       help="size: sizes only; full: sha256 (or git blob id) against the source's hashes")
    fetch.add_argument("--reverify", action="store_true", help="re-check every file, ignoring the marker")
    fetch.add_argument("--headroom", type=float, default=0.05, help="free-space margin as a fraction")
    fetch.add_argument("--retries", type=int, default=5,
                       help="retries per file (per byte range of a large file) after a failed transfer")
    fetch.add_argument("--connections", type=int, default=8, metavar="N",
                       help="parallel connections: several files at once and large files in 64 MiB byte "
                       "ranges (default 8, at most 32)")
    fetch.add_argument("--range-mib", type=int, default=64, metavar="MIB",
                       help="size of the byte ranges a large file is fetched in (default 64)")
    fetch.add_argument("--progress-file", type=Path, help="write progress (bytes done/total, rate) as JSON")
    fetch.add_argument("--token-file", type=Path, metavar="FILE",
                       help="read the hub token from FILE (root-only) instead of the environment")
    fetch.add_argument("--check", action="store_true",
                       help="only report whether DEST is complete (exit 0) or not (exit 1); no network")
    fetch.add_argument("--write-manifest", action="store_true",
                       help="write DEST/kimi-manifest.json (for an http mirror of DEST) and exit")
    fetch.set_defaults(handler=_run_fetch)


def _read_token(path: Path) -> str:
    from kimi_service import weights

    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise UsageError(f"--token-file {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise UsageError(f"--token-file {path}: not UTF-8 text; it is not shown here") from None
    # Checked before it goes into a header: httpx's error for a bad header value quotes the value.
    return weights.check_token(text.strip(), f"--token-file {path}")


def _run_fetch(args: argparse.Namespace) -> int:
    from kimi_service import weights

    if args.write_manifest:
        print(weights.write_manifest(args.dest))
        return 0
    if not args.repo:
        raise UsageError("fetch needs --repo (only --write-manifest goes without it)")
    default_endpoint = {"hf": "https://huggingface.co", "modelscope": "https://www.modelscope.cn"}
    request = weights.FetchRequest(
        source=args.source, repo=args.repo, revision=args.revision, dest=args.dest,
        endpoint=args.endpoint or default_endpoint.get(args.source, ""), manifest_url=args.manifest_url,
        local_path=args.local_path, verify=args.verify, reverify=args.reverify, headroom=args.headroom,
        retries=args.retries, progress_file=args.progress_file, connections=args.connections,
        range_size=args.range_mib << 20,
        token=_read_token(args.token_file) if args.token_file else weights.token_from_env(args.source),
    )
    if args.check:
        request.validate()
        complete = weights.is_up_to_date(request)
        print(json.dumps({"dest": str(args.dest), "complete": complete}))
        return 0 if complete else 1
    print(json.dumps(weights.fetch(request).to_json()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        code = int(handler(args) or 0)
        sys.stdout.flush()  # a reader that left shows here rather than in the interpreter's exit
        return code
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        return _stdout_closed()
    except KimiError as exc:
        print(f"kimi-service: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket nobody reads any more (POLLERR on its write end): a broken pipe
    elsewhere (a child's stdin, a socket) is a fault of its own and keeps its traceback."""
    poller = select.poll()
    poller.register(sys.stdout.fileno(), select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _stdout_closed() -> int:
    """`kimi-service plan ... | head -1`: the reader has what it wanted. Quiet, with the status a shell gives
    any command SIGPIPE stops (128 + 13), so `set -o pipefail` still sees the output was cut short; stdout
    goes to /dev/null so the interpreter's own flush at exit finds no pipe to break again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return SIGPIPE_EXIT_STATUS
