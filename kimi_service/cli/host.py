"""The commands that run on a host or against its endpoint: `bench`, `serve`, `tune`, `health`, `smoke`, `ctl`
and `exporter`."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from kimi_service.cli.args import config_arg, env_file_arg, float_list, int_list, request_shape, secret
from kimi_service.errors import UsageError
from kimi_service.untrusted import decimal, seconds, whole


def add_bench(commands) -> None:
    bench = commands.add_parser(
        "bench", help="concurrency sweep against an OpenAI-compatible endpoint",
        description="Measure TTFT, inter-token latency, end-to-end latency, throughput and goodput "
        "at each concurrency level against an OpenAI-compatible streaming endpoint.",
    )
    bench.add_argument("--url", default="http://127.0.0.1:8000", help="endpoint base URL")
    bench.add_argument("--model", required=True, help="served model name")
    bench.add_argument("--api-key-env", metavar="VAR", default="VLLM_API_KEY",
                       help="environment variable holding the API key (default VLLM_API_KEY)")
    env_file_arg(bench)
    bench.add_argument("--concurrency", type=int_list, default=[1, 4, 16, 64],
                       help="closed-loop levels: that many clients each, e.g. 1,4,16,64")
    bench.add_argument("--request-rate", type=float_list, default=[], metavar="RATES",
                       help="open-loop levels instead: Poisson arrivals at each rate in requests/s, e.g. 1,2,4 "
                       "(--prompts requests per level, sent whether or not earlier ones finished)")
    bench.add_argument("--input-len", type=whole, default=512, help="prompt tokens per request")
    bench.add_argument("--output-len", type=whole, default=128, help="output tokens per request")
    bench.add_argument("--prompts", type=whole, default=64, help="requests per concurrency level")
    bench.add_argument("--shared-prefix-len", type=whole, default=0,
                       help="tokens of one system prompt shared by every request")
    bench.add_argument("--api", choices=["chat", "completions"], default="chat")
    bench.add_argument("--slo", help="goodput objectives, e.g. ttft=2,itl=0.1 (seconds)")
    bench.add_argument("--tokenizer", help="tokenizer directory (default: the model's directory)")
    bench.add_argument("--seed", type=whole, default=0)
    bench.add_argument("--json", dest="json_path", type=Path, metavar="FILE", help="write results as JSON")
    bench.add_argument("--plot", type=Path, metavar="FILE.png", help="write a PNG plot")
    bench.set_defaults(handler=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from kimi_service import bench, bench_report

    settings = bench.BenchSettings(
        url=args.url, model=args.model, api_key=secret(args, args.api_key_env),
        api_key_env=args.api_key_env, concurrency=args.concurrency, input_len=args.input_len,
        output_len=args.output_len, prompts=args.prompts, shared_prefix_len=args.shared_prefix_len, api=args.api,
        slo=bench.Slo.parse(args.slo), tokenizer=args.tokenizer, seed=args.seed, request_rates=args.request_rate,
    )
    report = bench.run_bench(settings)
    print(bench_report.format_table(report))
    if args.json_path:
        args.json_path.write_text(json.dumps(report.to_json(), indent=2))
    if args.plot:
        bench_report.write_plot(report, args.plot)
    return 1 if any(level.errors for level in report.levels) else 0


def _log_to_journal() -> None:
    import logging

    # systemd's journal adds the time and unit; keep lines short.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # httpx logs every request at INFO: the supervisor's probes (and a leader's probes of its followers),
    # every few seconds, would bury the engine's own lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def add_serve(commands) -> None:
    serve = commands.add_parser("serve", help="plan and run vLLM under systemd (Type=notify) or supervisord",
                                description="Plan from the hardware and model, run the vLLM OpenAI "
                                "server, report readiness and watchdog pings to systemd; without systemd's "
                                "watchdog, watch the engine itself (serve.watchdog_sec).")
    config_arg(serve)
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


def add_tune(commands) -> None:
    from kimi_service.tuned import DEFAULT_SLO

    tune = commands.add_parser(
        "tune", help="measure speed flags on this host and keep only what beats the plan",
        description="Start the engine once per candidate flag set (the service must be stopped: the GPU and "
        "the API port are needed), sweep each with the workload, and write the winner to STATE_DIR/tuned.json, "
        "which serve applies once the gain held when measured again. Each point's goodput has a bootstrap band; "
        "a candidate is applied only when its band lies above the plan's somewhere and below 0.98x of it nowhere. "
        "Measurements are kept as they finish: a second run resumes.",
    )
    config_arg(tune)
    tune.add_argument("--env-file", type=Path, metavar="FILE",
                      help="secrets.env to read first (VLLM_API_KEY, HF_TOKEN), as serve does")
    tune.add_argument("--user", metavar="NAME", help="started as root: become NAME after reading --env-file")
    tune.add_argument("--budget", default="20m", help="time for all candidates, e.g. 20m, 1h (default 20m)")
    tune.add_argument("--concurrency", type=int_list, default=[1, 16, 64], help="closed-loop levels (1,16,64)")
    tune.add_argument("--input-len", type=whole, default=512, help="prompt tokens per request (512)")
    tune.add_argument("--output-len", type=whole, default=128, help="output tokens per request (128)")
    tune.add_argument("--prompts", type=whole, default=64,
                      help="requests per level: at least this, 64 and 4 per client (64)")
    tune.add_argument("--shared-prefix-len", type=whole, default=0, help="tokens of one shared system prompt")
    tune.add_argument("--also-shape", action="append", default=[], type=request_shape, metavar="IN/OUT[+PREFIX]",
                      help="another request shape the winner must serve too, e.g. 8192/256 or 512/128+2000 "
                           "(repeatable): every engine start is swept with each, and a loss on any loses")
    tune.add_argument("--slo", default=DEFAULT_SLO,
                      help=f"goodput objectives: vLLM's ttft, tpot, e2el, and itl (every gap) if asked "
                      f"(default {DEFAULT_SLO})")
    tune.add_argument("--candidate", action="append", default=[], metavar="FLAGS",
                      help="measure this flag set instead of the automatic ones (repeat for more), "
                      "e.g. --candidate '--max-num-seqs 64'")
    tune.add_argument("--allow-speculative", action="store_true",
                      help="let a speculative-decoding winner be applied (by default it is measured and reported "
                      "only: its gain depends on real text and weights, which tune's synthetic prompts lack)")
    tune.add_argument("--verify", action="store_true",
                      help="measure tuned.json's flags again between two runs of the plan; serve applies them only "
                      "when the gain held (exit 0 held, 1 not)")
    tune.add_argument("--status", action="store_true",
                      help="measure nothing: exit 0 when tuned.json holds for this configuration and workload, "
                      "3 when tuning would measure")
    tune.set_defaults(handler=_run_tune)


def _run_tune(args: argparse.Namespace) -> int:
    from kimi_service import bench, config, tune, tune_report
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
    session = tune.Session(loaded, workload, tune.parse_duration(args.budget), args.candidate,
                           allow_speculative=args.allow_speculative)
    if args.status:
        why = session.stale()
        print(why or f"{session.tuned_path}: current for this configuration and workload")
        return 3 if why else 0
    if args.verify:
        tuned = session.verify(api_key=secret(args, "VLLM_API_KEY"))
        print(f"{' '.join(tuned['flags'])}: {tuned['verification']}")
        return 0 if tuned["gain_held"] else 1
    outcome = session.run(api_key=secret(args, "VLLM_API_KEY"))
    print(tune_report.format_table(outcome, workload.slo))
    print(f"applied: {' '.join(outcome.winner.candidate.flags) or 'the plan alone (nothing beat it)'}; "
          f"written to {session.tuned_path}; restart the engine to serve with it")
    return 0


def add_health(commands) -> None:
    check = commands.add_parser("health", help="check the endpoint and GPUs (exit 0 ok, 1 degraded, 2 down)")
    config_arg(check)
    check.add_argument("--url", help="API base URL (default: from the config, else http://127.0.0.1:8000)")
    check.add_argument("--model", help="served model name that must be listed (default: from the config)")
    check.add_argument("--json", action="store_true", help="print every check as JSON")
    check.add_argument("--wait", type=seconds, default=0.0, metavar="SECONDS",
                       help="retry until healthy or this many seconds pass")
    check.add_argument("--no-smoke", action="store_true", help="skip the smoke chat completion")
    check.add_argument("--no-gpu", action="store_true", help="skip the NVML checks")
    check.add_argument("--every", type=seconds, metavar="SECONDS",
                       help="loop: check every SECONDS forever, one log line per result (what kimi-health.timer "
                       "does under systemd, for supervisord); stops on SIGTERM with exit 0")
    env_file_arg(check)
    check.set_defaults(handler=_run_health)


def _run_health(args: argparse.Namespace) -> int:
    from kimi_service import config, health
    from kimi_service.credentials import API_KEY_VAR

    cfg = config.load_config(args.config) if args.config.exists() or not args.url else None
    target = health.Target(
        url=(args.url or cfg.api.local_url).rstrip("/"),
        served_name=args.model or (cfg.model.served_name if cfg else None),
        api_key=secret(args, API_KEY_VAR),
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


def add_smoke(commands) -> None:
    smoke = commands.add_parser("smoke", help="one chat completion, the key from the env file (exit 0 ok, 1 failed)",
                                description="Send one chat completion the way a client would, with VLLM_API_KEY "
                                "from the environment or --env-file (never from argv), and report its latency "
                                "and the start of the reply.")
    smoke.add_argument("--url", default="http://127.0.0.1:8000", help="API base URL (default http://127.0.0.1:8000)")
    env_file_arg(smoke)
    smoke.add_argument("--model", help="served model name (default: the first /v1/models lists)")
    smoke.add_argument("--max-tokens", type=whole, default=8, help="tokens to ask for (default 8)")
    smoke.add_argument("--timeout", type=decimal, default=60.0, help="seconds the completion may take (default 60)")
    smoke.add_argument("--json", action="store_true", help="print the result as JSON")
    smoke.set_defaults(handler=_run_smoke)


def _run_smoke(args: argparse.Namespace) -> int:
    from kimi_service import health
    from kimi_service.credentials import API_KEY_VAR
    from kimi_service.http_client import client_for

    target = health.Target(url=args.url.rstrip("/"), served_name=args.model, api_key=secret(args, API_KEY_VAR),
                           timeout=args.timeout, smoke_max_tokens=args.max_tokens)
    with client_for(target.url) as client:
        model = args.model or health.served_model(client, target)
        if model is None:
            result = health.SmokeResult(False, target.url, "", None, None, None, None,
                                        f"{target.url}/v1/models named no model (unreachable, or a wrong key); "
                                        "pass --model")
        else:
            result = health.smoke_completion(client, target, model)
    print(json.dumps(result.to_json()) if args.json else result.to_text())
    return 0 if result.ok else 1


def add_ctl(commands) -> None:
    from kimi_service import ctl

    control = commands.add_parser(
        "ctl", help="start, stop, restart or show the services under systemd or supervisord",
        description="The same verbs on either service manager: systemctl where systemd runs the host, "
        "supervisorctl otherwise. start/restart of kimi-vllm waits for serve's /ready and, when the start "
        "fails, prints the engine's own first error and where the log is. status exits 0 when all run, 3 not.")
    control.add_argument("action", choices=["start", "stop", "restart", "status"])
    control.add_argument("programs", nargs="*", metavar="PROGRAM",
                         help=f"any of {', '.join(ctl.PROGRAMS)} (default: all three)")
    config_arg(control)
    control.add_argument("--wait", type=seconds, metavar="SECONDS",
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


def add_exporter(commands) -> None:
    exporter = commands.add_parser("exporter", help="Prometheus exporter: GPU (dcgm names), health, plan")
    config_arg(exporter)
    exporter.add_argument("--port", type=whole, help="listen port (default: exporter.port of the config, 9400)")
    exporter.add_argument("--host", help="listen address (default: exporter.host of the config)")
    exporter.set_defaults(handler=_run_exporter)


def _run_exporter(args: argparse.Namespace) -> int:
    import logging
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
