"""Chat with a running ``kvtier serve`` through the official ``openai`` client, twice with the
same system prompt, and print how many prompt tokens each answer read from the cache.

It starts nothing itself; start a server first, e.g.::

    kvtier serve tiny
    python examples/openai_chat.py [--base-url http://127.0.0.1:8000/v1]

The second request shares the first one's system prompt, so its
``usage.prompt_tokens_details.cached_tokens`` counts that prefix; kvtier adds
``cached_tokens_by_tier`` (``device``/``host``/``storage``) beside it. Run it again against a
server restarted on the same ``--storage-dir`` and the first request is served from storage.
(The presets have random weights: the replies are noise; the cache figures are the point.)
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI

SYSTEM = (
    "You are a terse assistant for a team that runs language models in production. "
    "Answer in one sentence, name the trade-off, and never invent figures."
)
QUESTIONS = ["What does a KV cache store?", "Why keep one on the host as well as the GPU?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("KVTIER_API_KEY", "unused"),
        help="the server's --api-key (default: $KVTIER_API_KEY)",
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id  # the name the server serves its model as
    for question in QUESTIONS:
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            max_tokens=args.max_tokens,
            temperature=0,
        )
        details = r.usage.prompt_tokens_details
        by_tier = (details.model_extra or {}).get("cached_tokens_by_tier")
        print(
            f"{question!r}: prompt_tokens={r.usage.prompt_tokens} "
            f"cached_tokens={details.cached_tokens} by tier={by_tier}"
        )


if __name__ == "__main__":
    main()
