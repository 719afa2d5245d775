"""The commands that need no deployed host: `plan` (will it fit, from a directory or the hub), `gpus` and `fetch`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kimi_service.cli.args import hub_args, hub_endpoint, hub_token
from kimi_service.config import WORKLOADS
from kimi_service.errors import UsageError
from kimi_service.untrusted import decimal, whole


def add_plan(commands) -> None:
    plan = commands.add_parser(
        "plan", help="will the model fit? tuned vLLM flags, or what would fit (exit 0 fits, 3 no, 2 bad input)",
        description="Plan vLLM for a model on given GPUs without touching them: tensor/pipeline parallel sizes, "
        "context length, memory budget and the reason for every flag.",
    )
    plan.add_argument("--model", required=True, metavar="DIR_OR_REPO_ID",
                      help="a model directory with config.json, or a hub repo id ORG/NAME: a catalog model plans "
                      "from the catalog, any other from its listing and small files on the hub (never weights)")
    plan.add_argument("--gpus", required=True, metavar="SPEC",
                      help="NAME:COUNT, COUNTxNAME or NAME:COUNT:MEMORY (A100-SXM4-80GB:4, 8xH200, L40S:2:48GiB); "
                      "cpu[:MEMORY] for the CPU engine")
    plan.add_argument("--nodes", type=whole, default=1, help="nodes with SPEC GPUs each (default 1)")
    plan.add_argument("--max-model-len", type=whole, metavar="N", help="context length to plan for")
    plan.add_argument("--workload", default="chat", help=", ".join(WORKLOADS))
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    hub_args(plan, sources=("hf", "modelscope", "http"))
    plan.add_argument("--cache-dir", type=Path, metavar="DIR",
                      help="where the hub's small files are kept by commit (default $XDG_CACHE_HOME/kimi-service/hub, "
                      "else ~/.cache/kimi-service/hub)")
    plan.add_argument("--offline", action="store_true",
                      help="read the hub's files from the cache only (a branch: the commit it named last)")
    plan.add_argument("--timeout", type=decimal, default=120.0, metavar="SECONDS",
                      help="how long reading the hub may take in all (default %(default)g)")
    plan.set_defaults(handler=_run_plan)


def _plan_model(args: argparse.Namespace):
    """The ModelSpec of --model, and the hub's record of it when the hub described it."""
    from kimi_service import catalog, hub, model

    try:
        local = Path(args.model).expanduser().is_dir()
    except RuntimeError:  # `~name/...` for a user this host lacks: inspect_model says so
        local = True
    if local or catalog.get(args.model):
        return model.inspect_model(args.model), None
    if args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout:g}: give a number of seconds > 0")
    source = hub.Source(args.source, hub_endpoint(args), hub_token(args), args.manifest_url)
    if not (source.endpoint or source.manifest_url):
        raise UsageError("--source http needs --endpoint URL (the mirror's base URL)")
    found = hub.inspect(args.model, args.revision, source, args.cache_dir or hub.default_cache_dir(),
                        offline=args.offline, deadline=args.timeout)
    origin = model.Origin(repo=found.repo, commit=found.commit, weight_bytes=found.weight_bytes)
    return model.inspect_model(str(found.directory), origin), found


def _run_plan(args: argparse.Namespace) -> int:
    from kimi_service import hardware, planner

    gpus = hardware.parse_gpu_spec(args.gpus)
    spec, found = _plan_model(args)
    if found and found.offline_note and not args.json:
        print(found.offline_note, file=sys.stderr)
    try:
        result = planner.plan(
            spec, gpus, nodes=args.nodes, workload=args.workload, max_model_len=args.max_model_len
        )
    except planner.DoesNotFit as exc:
        if args.json:
            print(json.dumps({"fits": False, "error": str(exc), "needed_bytes": exc.needed_bytes,
                              "available_bytes": exc.available_bytes, "suggestions": exc.suggestions,
                              "hub": found.to_json() if found else None}, indent=2))
        raise
    if args.json:
        print(json.dumps({**result.to_json(), "hub": found.to_json() if found else None}, indent=2))
        return 0
    print(planner.render(result))
    if found:
        print(f"\nfrom the hub: {found.repo}@{found.revision}, commit {found.commit} ({found.endpoint})")
    return 0


def add_gpus(commands) -> None:
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


def add_fetch(commands) -> None:
    fetch = commands.add_parser(
        "fetch", help="download model weights resumably and verify them (hub, ModelScope, mirror, local)",
        description="List the repository's files, check free space, download what is missing (resuming "
        "partial files), verify sizes (and sha256 with --verify full; a published hash is always checked "
        "for what this run downloads) and write a marker, so a rerun "
        "is a no-op. A hub token is read from HF_TOKEN (MODELSCOPE_API_TOKEN) or --token-file, never "
        "from arguments.",
    )
    fetch.add_argument("--repo", help="repository id, e.g. moonshotai/Kimi-K2.5 (needed for all but --write-manifest)")
    fetch.add_argument("--dest", type=Path, required=True, help="model directory to fill")
    hub_args(fetch, sources=("hf", "modelscope", "http", "local"))
    fetch.add_argument("--local-path", type=Path, help="local source: directory holding the files")
    fetch.add_argument("--verify", choices=["size", "full"], default="size",
                       help="size: sizes only; full: sha256 (or git blob id) against the source's hashes")
    fetch.add_argument("--reverify", action="store_true", help="re-check every file, ignoring the marker")
    fetch.add_argument("--headroom", type=decimal, default=0.05, help="free-space margin as a fraction")
    fetch.add_argument("--retries", type=whole, default=5,
                       help="retries per file (per byte range of a large file) after a failed transfer")
    fetch.add_argument("--connections", type=whole, default=8, metavar="N",
                       help="parallel connections: several files at once and large files in 64 MiB byte "
                       "ranges (default 8, at most 32)")
    fetch.add_argument("--range-mib", type=whole, default=64, metavar="MIB",
                       help="size of the byte ranges a large file is fetched in (default 64)")
    fetch.add_argument("--progress-file", type=Path, help="write progress (bytes done/total, rate) as JSON")
    fetch.add_argument("--redirect-host", action="append", default=[], metavar="HOST",
                       help="a host a file without a published hash may be redirected to (a mirror's CDN; "
                       "repeat for several); a file with a published hash may go anywhere, it is checked")
    fetch.add_argument("--expect-commit", default="", metavar="COMMIT",
                       help="refuse to fetch when the revision names another commit (the one the plan read)")
    fetch.add_argument("--check", action="store_true",
                       help="only report whether DEST is complete (exit 0) or not (exit 1); no network")
    fetch.add_argument("--write-manifest", action="store_true",
                       help="write DEST/kimi-manifest.json (for an http mirror of DEST) and exit")
    fetch.set_defaults(handler=_run_fetch)


def _run_fetch(args: argparse.Namespace) -> int:
    from kimi_service import weights

    if args.write_manifest:
        print(weights.write_manifest(args.dest))
        return 0
    if not args.repo:
        raise UsageError("fetch needs --repo (only --write-manifest goes without it)")
    request = weights.FetchRequest(
        source=args.source, repo=args.repo, revision=args.revision, dest=args.dest,
        endpoint=hub_endpoint(args), manifest_url=args.manifest_url,
        local_path=args.local_path, verify=args.verify, reverify=args.reverify, headroom=args.headroom,
        retries=args.retries, progress_file=args.progress_file, connections=args.connections,
        range_size=args.range_mib << 20, redirect_hosts=tuple(args.redirect_host),
        token=hub_token(args), expect_commit=args.expect_commit,
    )
    if args.check:
        request.validate()
        complete = weights.is_up_to_date(request)
        print(json.dumps({"dest": str(args.dest), "complete": complete}))
        return 0 if complete else 1
    print(json.dumps(weights.fetch(request).to_json()))
    return 0
