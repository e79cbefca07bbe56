"""A bounded load test against a running server: a fixed number of streaming completions at a fixed concurrency;
it stops by itself and reports requests/s, tokens/s and latency percentiles (end to end and to the first token).

    python -m hylo.server.load_test --url http://127.0.0.1:8000 --requests 64 --concurrency 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import sys
import time


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def run_load(url: str, num_requests: int = 64, concurrency: int = 16, max_tokens: int = 32,
                   api_key: str | None = None, model: str | None = None, seed: int = 0,
                   timeout_s: float = 600.0) -> dict:
    import httpx

    rng = random.Random(seed)
    words = ["def", "class", "return", "import", "for", "while", "lambda", "yield", "with", "async"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 30))) for _ in range(num_requests)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency)
    latencies, ttfts, tokens, errors = [], [], [], []

    async def one(client, prompt):
        async with sem:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            if model:
                body["model"] = model
            t0 = time.perf_counter()
            first = None
            used = 0
            async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    errors.append(f"{resp.status_code}: {(await resp.aread())[:200]!r}")
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if first is None and data.get("choices"):
                        first = time.perf_counter()
                    if data.get("usage"):
                        used = data["usage"]["completion_tokens"]
            done = time.perf_counter()
            latencies.append(done - t0)
            ttfts.append((first or done) - t0)
            tokens.append(used)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        await asyncio.gather(*(one(client, p) for p in prompts))
    wall = time.perf_counter() - t0
    return {
        "requests": num_requests, "concurrency": concurrency, "max_tokens": max_tokens, "succeeded": len(latencies),
        "errors": errors, "wall_s": wall, "requests_per_s": len(latencies) / wall,
        "output_tokens_per_s": sum(tokens) / wall, "output_tokens": sum(tokens),
        "latency_s": {f"p{int(q * 100)}": _percentile(latencies, q) for q in (0.5, 0.9, 0.99)},
        "ttft_s": {f"p{int(q * 100)}": _percentile(ttfts, q) for q in (0.5, 0.9, 0.99)},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    if importlib.util.find_spec("httpx") is None:
        print("error: the load test needs httpx: pip install httpx (or bash scripts/setup.sh client)",
              file=sys.stderr)
        return 2
    report = asyncio.run(run_load(args.url, args.requests, args.concurrency, args.max_tokens, args.api_key,
                                  args.model))
    print(json.dumps(report, indent=1))
    return 0 if not report["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
