"""Naive serving: Hugging Face transformers `generate` behind a one-request-at-a-time HTTP server.

The baseline the benchmark compares vLLM with: no batching, no paged KV cache, no prefix cache;
requests wait on one lock, as a hand-written endpoint around `model.generate` does. It speaks enough
of the OpenAI chat-completions API for `kimi-service bench`: streaming SSE chunks with delta content,
a final usage chunk and `[DONE]`, `max_tokens`, `ignore_eos`/`min_tokens`, temperature; plus
`/health` and `/v1/models`.

Usage: naive_server.py --model DIR [--served-model-name NAME] [--host H] [--port P] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

_END = object()


class TokenQueue(BaseStreamer):
    """Hands each generated token id to the HTTP thread as `generate` produces it."""

    def __init__(self) -> None:
        self.tokens: queue.Queue[Any] = queue.Queue()
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        # generate() passes the prompt first; only what follows is output.
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.tokens.put(int(token))

    def end(self) -> None:
        self.tokens.put(_END)


class TextDeltas:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


class Engine:
    def __init__(self, model_dir: str, device: str, served_name: str) -> None:
        self.model_dir, self.served_name, self.device = model_dir, served_name, device
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
        self.lock = threading.Lock()
        # The most requests the server held at once (one generating, the rest waiting): /health reports it.
        self.in_flight = self.peak_in_flight = 0
        self._count_lock = threading.Lock()

    def count(self, change: int) -> None:
        with self._count_lock:
            self.in_flight += change
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def prompt_ids(self, body: dict[str, Any]) -> torch.Tensor:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: a non-empty list of {role, content} is required")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids.to(self.device)

    def generate(self, ids: torch.Tensor, body: dict[str, Any], streamer: TokenQueue) -> None:
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        min_tokens = max_tokens if body.get("ignore_eos") else min(int(body.get("min_tokens") or 0), max_tokens)
        temperature = float(body.get("temperature", 1.0) or 0.0)
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        try:
            with torch.inference_mode():
                self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                    min_new_tokens=min_tokens, streamer=streamer,
                    pad_token_id=self.tokenizer.pad_token_id, **sampling,
                )
        finally:
            streamer.end()


def _chunk(rid: str, model: str, created: int, delta: dict | None, finish: str | None = None,
           usage: dict | None = None) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    payload: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                               "model": model, "choices": choices}
    if usage is not None:
        payload["usage"] = usage
    return f"data: {json.dumps(payload)}\n\n".encode()


def make_handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:
            pass

        def _json(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {"status": "ok", "peak_in_flight": engine.peak_in_flight})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [
                    {"id": engine.served_name, "object": "model", "root": engine.model_dir, "owned_by": "naive"}]})
            else:
                self._json(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            if self.path != "/v1/chat/completions":
                self._json(404, {"error": {"message": f"no route {self.path}"}})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                ids = engine.prompt_ids(body)
            except (ValueError, TypeError) as exc:
                self._json(400, {"error": {"message": str(exc), "type": "invalid_request_error"}})
                return
            engine.count(+1)
            try:
                with engine.lock:
                    self._serve(body, ids)
            finally:
                engine.count(-1)

        def _serve(self, body: dict[str, Any], ids: torch.Tensor) -> None:
            rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
            streamer, deltas = TokenQueue(), TextDeltas(engine.tokenizer)
            worker = threading.Thread(target=engine.generate, args=(ids, body, streamer), daemon=True)
            worker.start()
            stream = bool(body.get("stream"))
            if stream:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(_chunk(rid, engine.served_name, created, {"role": "assistant", "content": ""}))
            count = 0
            while (token := streamer.tokens.get()) is not _END:
                count += 1
                delta = deltas.add(token)
                if stream and delta:
                    self.wfile.write(_chunk(rid, engine.served_name, created, {"content": delta}))
                    self.wfile.flush()
            worker.join()
            prompt_tokens = int(ids.shape[1])
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": count,
                     "total_tokens": prompt_tokens + count}
            finish = "length" if count >= int(body.get("max_tokens") or 16) else "stop"
            if not stream:
                self._json(200, {"id": rid, "object": "chat.completion", "created": created,
                                 "model": engine.served_name, "usage": usage, "choices": [{
                                     "index": 0, "finish_reason": finish,
                                     "message": {"role": "assistant", "content": deltas.sent}}]})
                return
            self.wfile.write(_chunk(rid, engine.served_name, created, {}, finish))
            if (body.get("stream_options") or {}).get("include_usage"):
                self.wfile.write(_chunk(rid, engine.served_name, created, None, usage=usage))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model directory (config.json, safetensors, tokenizer)")
    parser.add_argument("--served-model-name", help="name clients send (default: the directory)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    started = time.perf_counter()
    engine = Engine(args.model, args.device, args.served_model_name or args.model)
    # Every waiting client holds a connection open; the default listen backlog of 5 drops some.
    ThreadingHTTPServer.request_queue_size = 256
    server = ThreadingHTTPServer((args.host, args.port), make_handler(engine))
    server.daemon_threads = True
    print(f"naive server: {args.model} on {args.device} loaded in {time.perf_counter() - started:.1f} s; "
          f"listening on http://{args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
