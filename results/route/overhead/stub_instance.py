"""A stand-in for ``kvtier serve`` that answers every completion after 20 ms (then 7 more
chunks 3 ms apart, and a usage chunk), for timing what a front adds:
``python stub_instance.py PORT``."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

app = FastAPI()
CHUNK = b'data: {"choices": [{"index": 0, "text": "a", "token_ids": [97]}]}\n\n'
USAGE = {
    "prompt_tokens": 10,
    "completion_tokens": 8,
    "prompt_tokens_details": {
        "cached_tokens_by_tier": {"device": 0, "host": 0, "storage": 0},
        "recomputed_tokens": 10,
    },
}


@app.get("/health")
async def health() -> dict[str, Any]:
    return {"status": "ok"}


@app.get("/v1/models")
async def models() -> dict[str, Any]:
    card = {"id": "tiny", "page_size": 16, "tokenizer": "bytes", "vocab_size": 512}
    return {"object": "list", "data": [card]}


@app.post("/v1/completions")
async def completions(request: Request) -> StreamingResponse:
    await request.body()

    async def stream() -> AsyncIterator[bytes]:
        await asyncio.sleep(0.02)
        yield CHUNK
        for _ in range(7):
            await asyncio.sleep(0.003)
            yield CHUNK
        yield ("data: " + json.dumps({"choices": [], "usage": USAGE}) + "\n\n").encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
