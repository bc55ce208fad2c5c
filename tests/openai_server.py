"""A small OpenAI-compatible server for the tests: real HTTP on 127.0.0.1, real generation.

    python tests/openai_server.py --port P [--model tiny] [--script FILE]

- `/v1/completions` with a token-id prompt samples from the tiny model (the project's HFBackend)
  and answers with vLLM's extensions: `token_ids` and `logprobs.token_logprobs` per choice.
- `/v1/chat/completions` (also streamed, `stream: true`) answers from a script when one is given (a JSON object: marker ->
  list of replies `{"content": ..., "tool_calls": [[name, arguments], ...]}`; the reply for a
  conversation is the one under the marker its first user message contains, indexed by the
  number of assistant messages so far; markers may be grouped under a served model name, an
  object of markers, for conversations whose first user messages are alike), else samples
  from the tiny model through its chat template and returns the text.
- `POST /control {"fault": F, "count": N}` makes the next N model requests misbehave: "429",
  "500", "timeout" (no reply for 30 s), "truncated" (half a JSON body), "bad_ids" (a token id past
  the vocabulary), "huge" (a 10 MB body), "gzip" (a compressed body), "nan" (a NaN logprob), "tiny_logprob" (-1e308).
- `GET /v1/models` answers (an empty list), as the server check before any episode asks.
- `GET /log` lists the requests seen (route, policy version header, whether a key was sent).
- `GET /launch`: its arguments and VLLM_* environment variables, when started in `vllm serve`'s
  place by `generation.serve` (it takes vLLM's arguments and ignores all but --port).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import threading
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

app = FastAPI()
STATE: dict[str, Any] = {"fault": None, "count": 0, "log": [], "script": None, "launch": {}}
_LOCK = threading.Lock()
_MODEL: dict[str, Any] = {}


def _backend() -> Any:
    if "backend" not in _MODEL:
        from seeupo_gym.agents.backends import HFBackend
        from seeupo_gym.agents.models import load_model

        model, tokenizer = load_model("tiny", seed=0)
        _MODEL["tokenizer"] = tokenizer
        _MODEL["backend"] = HFBackend(model, tokenizer)
    return _MODEL["backend"]


def _take_fault() -> str | None:
    with _LOCK:
        if STATE["count"] > 0:
            STATE["count"] -= 1
            return STATE["fault"]
    return None


async def _faulty(fault: str | None, body: dict[str, Any]) -> Response | None:
    if fault == "429":
        return JSONResponse({"error": "rate limited"}, status_code=429)
    if fault == "500":
        return JSONResponse({"error": "boom"}, status_code=500)
    if fault == "timeout":
        await asyncio.sleep(30)
        return JSONResponse(body)
    if fault == "truncated":
        text = json.dumps(body)
        return Response(text[: len(text) // 2], media_type="application/json")
    if fault == "huge":
        return Response(b'{"choices": [{"text": "' + b"a" * 10_000_000 + b'"}]}', media_type="application/json")
    if fault == "gzip":
        return Response(gzip.compress(json.dumps(body).encode()), media_type="application/json",
                        headers={"Content-Encoding": "gzip"})
    return None


def _log(request: Request, route: str, data: dict[str, Any]) -> None:
    with _LOCK:
        STATE["log"].append({
            "route": route,
            "temperature": data.get("temperature"),
            "seed": data.get("seed"),
            "model": data.get("model"),
            "lora_name": data.get("lora_name"),
            "policy_version": request.headers.get("x-policy-version"),
            "authorized": request.headers.get("authorization", "").startswith("Bearer "),
        })


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@app.get("/v1/models")
async def models() -> dict[str, Any]:
    # The route seeupo's server check asks before any episode; an empty list names no model to check.
    return {"object": "list", "data": []}


@app.post("/control")
async def control(request: Request) -> dict[str, Any]:
    data = await request.json()
    with _LOCK:
        STATE["fault"], STATE["count"] = data.get("fault"), int(data.get("count", 1))
    return {"ok": True}


@app.get("/log")
async def log() -> list[dict[str, Any]]:
    return STATE["log"]


@app.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    """vLLM's runtime LoRA route: the adapter under its name, on a copy of the base model."""
    data = await request.json()
    _log(request, "load_lora_adapter", data)
    from peft import PeftModel

    from seeupo_gym.agents.backends import HFBackend
    from seeupo_gym.agents.models import load_model

    base, tokenizer = load_model("tiny", seed=0)
    model = PeftModel.from_pretrained(base, data["lora_path"]).eval()
    _MODEL.setdefault("adapters", {})[data["lora_name"]] = HFBackend(model, tokenizer)
    return JSONResponse({"ok": True})


@app.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    data = await request.json()
    _log(request, "unload_lora_adapter", data)
    if _MODEL.get("adapters", {}).pop(data["lora_name"], None) is None:
        return JSONResponse({"error": "no such adapter"}, status_code=404)
    return JSONResponse({"ok": True})


@app.post("/v1/completions")
async def completions(request: Request) -> Response:
    data = await request.json()
    _log(request, "completions", data)
    from seeupo_gym.agents.backends import SamplingParams

    backend = _backend()
    if data.get("model") in _MODEL.get("adapters", {}):
        backend = _MODEL["adapters"][data["model"]]
    elif str(data.get("model", "")).startswith("policy-v"):
        return JSONResponse({"error": f"no adapter {data['model']}"}, status_code=404)
    sampling = SamplingParams(
        temperature=float(data.get("temperature", 1.0)),
        top_p=float(data.get("top_p", 1.0)),
        max_new_tokens=int(data.get("max_tokens", 16)),
        stop_token_ids=tuple(data.get("stop_token_ids") or ()),
        seed=data.get("seed"),
    )
    (completion,) = await asyncio.to_thread(backend.generate, [list(data["prompt"])], sampling)
    token_ids, logprobs = list(completion.token_ids), list(completion.logprobs)
    fault = _take_fault()
    if fault == "bad_ids":
        token_ids[0] = 10**9
    if fault == "nan":
        logprobs[0] = float("nan")
    if fault == "tiny_logprob":  # finite, and enough of them overflow a sum
        logprobs[0] = -1e308
    body = {
        "object": "text_completion",
        "model": data.get("model"),
        "choices": [{
            "index": 0,
            "text": _MODEL["tokenizer"].decode(token_ids[:-1] if fault == "bad_ids" else token_ids),
            "token_ids": token_ids,
            "logprobs": {"token_logprobs": [x if x == x else "NaN" for x in logprobs]},
            "finish_reason": completion.finish_reason,
        }],
    }
    if fault == "nan":  # JSON has no NaN; Python's encoder writes one anyway, as some servers do
        return Response(json.dumps(body).replace('"NaN"', "NaN"), media_type="application/json")
    return await _faulty(fault, body) or JSONResponse(body)


@app.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    data = await request.json()
    _log(request, "chat", data)
    messages = data["messages"]
    fault = _take_fault()
    if STATE["script"] is not None:
        first_user = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
        turn = sum(m.get("role") == "assistant" for m in messages)
        script = STATE["script"]
        if isinstance(script.get(data.get("model")), dict):  # markers under the requested model's name
            script = script[data["model"]]
        replies = next((r for marker, r in script.items() if marker in first_user), [])
        reply = replies[turn] if turn < len(replies) else {"content": "Done."}
        message: dict[str, Any] = {"role": "assistant", "content": reply.get("content")}
        if reply.get("tool_calls"):
            message["tool_calls"] = [
                {"id": f"call_{k}", "type": "function",
                 "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}
                for k, (name, arguments) in enumerate(reply["tool_calls"])
            ]
    else:
        from seeupo_gym.agents.backends import SamplingParams

        backend = _backend()
        tokenizer = _MODEL["tokenizer"]
        prompt = tokenizer.apply_chat_template(messages, tools=data.get("tools"), add_generation_prompt=True, tokenize=True)
        if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        sampling = SamplingParams(temperature=float(data.get("temperature", 1.0)),
                                  max_new_tokens=int(data.get("max_tokens", 16)), seed=data.get("seed"))
        (completion,) = await asyncio.to_thread(backend.generate, [list(prompt)], sampling)
        message = {"role": "assistant", "content": tokenizer.decode(completion.token_ids, skip_special_tokens=True)}
    # id, created and usage: what strict clients (NeMo Gym's vllm_model, verifiers) read too.
    body = {"id": f"chatcmpl-{len(STATE['log'])}", "object": "chat.completion", "created": 0, "model": data.get("model"),
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
    if data.get("stream"):
        return _faulty_stream(fault, body) if fault else _stream(body)
    return await _faulty(fault, body) or JSONResponse(body)


def _stream(body: dict[str, Any]) -> Response:
    """The answer as OpenAI's server-sent chunks (verifiers asks for `stream: true`)."""
    from fastapi.responses import StreamingResponse

    message = body["choices"][0]["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
    chunks = [{**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
              {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
              {**base, "choices": [], "usage": body["usage"]}]
    text = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
    return StreamingResponse(iter([text]), media_type="text/event-stream")


def _faulty_stream(fault: str, body: dict[str, Any]) -> Response:
    if fault in ("429", "500"):
        return JSONResponse({"error": {"message": f"injected {fault}"}}, status_code=int(fault))
    return _stream(body)


@app.get("/launch")
async def launch() -> dict[str, Any]:
    return STATE["launch"]


def main() -> None:
    import os
    import sys

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--script", help="a JSON file: marker -> replies (chat)")
    # Launched in `vllm serve`'s place (generation.serve tests): its other arguments are recorded, not used.
    args, _ = parser.parse_known_args()
    STATE["launch"] = {
        "argv": sys.argv[1:],
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
        "pid": os.getpid(),
    }
    if args.script:
        with open(args.script) as f:
            STATE["script"] = json.load(f)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
