"""Stand-ins for the router's in-process tests: a pool whose every prompt's first token is fixed, a decode
server over httpx's mock transport, the app's test client, and the tiny checkpoint's real tokenizer."""
from __future__ import annotations

import importlib.util
import json
import uuid
from pathlib import Path

import httpx

from dwdp.serve.kv import prompt_digest
from dwdp.serve.protocol import PrefillResult

MODEL = "dwdp-tiny"
EOS = 2
DECODED = [101, 102, 103, 104, 105, 106]  # what the stand-in decode server continues with, in order


class Pool:
    """What create_app reads from a WorkerPool; every prompt's first token is `first`, its KV a file in `kv_dir`."""

    def __init__(self, kv_dir, first: int = 7):
        self.model_info = {"vocab_size": 512, "max_position_embeddings": 4096, "forwards": "packed",
                           "padded_reason": ""}
        self.kv_dir, self.first, self.count = kv_dir, first, 0
        self.fail: Exception | None = None  # raised by submit (after the artifact is written)
        self.banned: list[tuple[int, ...]] = []  # each prompt's banned first tokens (min_tokens)

    def snapshot(self) -> dict:
        return {"status": "ok", "mode": "dwdp", "workers": [], "in_flight": 0, "retried": 0, "failed": 0,
                "redundancy": [], "tokens_per_s": 0.0}

    async def submit(self, ids, banned_first=()):
        self.count += 1
        self.banned.append(tuple(banned_first))
        first = self.first if self.first not in banned_first else max(banned_first) + 1  # the next best, say
        request_id = f"pf-{uuid.uuid4().hex}"
        path = self.kv_dir / f"{request_id}.safetensors"
        path.write_bytes(b"kv" * 8 * len(ids))
        if self.fail is not None:
            raise self.fail
        return PrefillResult(request_id=request_id, rank=0, first_token_id=first, prompt_tokens=len(ids),
                             queue_s=0.0, prefill_s=0.0, kv_write_s=0.0, batch_size=1, batch_tokens=len(ids),
                             prefetch_wait_s=0.0, kv={"path": str(path), "num_tokens": len(ids),
                                                      "prompt_sha256": prompt_digest(ids), "bytes": 16 * len(ids)})


class Decoder:
    """A stand-in decode server (httpx transport): /v1/models, and /v1/completions streaming DECODED[:max_tokens]
    (cut before [DONE], or with an error event, when asked to). Records every completion request's body."""

    def __init__(self, max_model_len: int = 2048, cut: bool = False, error: bool = False, status: int = 200):
        self.max_model_len, self.cut, self.error, self.status = max_model_len, cut, error, status
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "decoder", "max_model_len": self.max_model_len}]})
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "refused"}})
        tokens = DECODED[:body["max_tokens"]]
        events = []
        for i, token in enumerate(tokens):
            finish = "length" if i == len(tokens) - 1 else None
            events.append({"choices": [{"index": 0, "text": f" d{token}", "token_ids": [token],
                                        "finish_reason": finish}]})
            if self.error and i == 0:
                events.append({"error": {"message": "engine died", "code": 500}})
                break
        events.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(tokens),
                                                "prompt_tokens_details": {"cached_tokens": len(body["prompt"]) - 1}}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + ("" if self.cut else "data: [DONE]\n\n")
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})


def client(tmp_path, decoder: Decoder | None = None, api_key: str | None = None, first: int = 7, tokenizer=None,
            **front_fields):
    from fastapi.testclient import TestClient

    from dwdp.serve.api import create_app
    from dwdp.serve.config import ServeConfig
    from dwdp.serve.front import FrontConfig

    budget, statvfs = front_fields.pop("budget", None), front_fields.pop("statvfs", None)
    front = FrontConfig(decode_url="http://decoder:8100" if decoder else None, api_key=api_key, **front_fields)
    pool = Pool(tmp_path, first)
    app = create_app(pool, ServeConfig(), tokenizer, front, eos_ids=frozenset({EOS}),
                     decode_transport=httpx.MockTransport(decoder) if decoder else None, budget=budget,
                     statvfs=statvfs)
    client = TestClient(app, raise_server_exceptions=False)
    client.pool = pool
    return client


def sse(text: str) -> list:
    """The data of each server-sent event, parsed ("[DONE]" kept as it is)."""
    datas = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in datas]


def tiny_tokenizer(directory):
    """examples/save_tiny_checkpoint.py's tokenizer (words w4..w511, [PAD] [BOS] [EOS] [UNK], its chat
    template), saved in `directory` and loaded as transformers loads it."""
    from transformers import AutoTokenizer

    script = Path(__file__).resolve().parents[1] / "examples" / "save_tiny_checkpoint.py"
    spec = importlib.util.spec_from_file_location("save_tiny_checkpoint", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.save_tokenizer(str(directory), module.SHAPE["vocab"])
    return AutoTokenizer.from_pretrained(str(directory))
