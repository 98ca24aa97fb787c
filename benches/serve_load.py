#!/usr/bin/env python3
"""Streaming load against an OpenAI-compatible server (ternfleet serve or llama-server).

    serve_load.py URL --concurrency 1,4,16 [--requests-per-client 2] [--prompt-tokens 128]
                      [--gen-tokens 128] [--overload N] [--prefix-tokens 1000] --json OUT

Each of C clients sends requests one after another; a request is a /v1/completions stream
of a prompt given as token ids (the same ids for every server: seeded, from the ordinary part
of the vocabulary) with max_tokens = --gen-tokens and ignore_eos, so every request generates
exactly that many tokens. Per level: aggregate generated tokens/s (tokens / wall time of the
level), time to first token and inter-token latency p50/p99, errors. --overload N fires N
requests at once and reports how many were refused with 429 and how fast. --prefix-tokens P
sends two requests sharing a P-token prefix, one after the other, and reports both TTFTs.
Bounded: every request has a timeout.
"""
import argparse
import asyncio
import json
import random
import time

import httpx


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


def prompt_ids(seed, n, lo=1000, hi=20000):
    r = random.Random(seed)
    return [r.randrange(lo, hi) for _ in range(n)]


async def one(client, url, ids, gen, timeout):
    body = {"prompt": ids, "max_tokens": gen, "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    times = []
    status = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            status = r.status_code
            if status != 200:
                await r.aread()
                return {"status": status, "t0": t0, "t1": time.perf_counter(), "times": []}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                v = json.loads(data)
                if "error" in v:
                    status = 500
                    break
                ch = v.get("choices") or []
                if ch and (ch[0].get("text") or "") != "":
                    times.append(time.perf_counter())
                elif ch and ch[0].get("finish_reason") is None:
                    # a token whose text is held back still counts as generated
                    times.append(time.perf_counter())
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        return {"status": 0, "error": str(e), "t0": t0, "t1": time.perf_counter(), "times": times}
    return {"status": status, "t0": t0, "t1": time.perf_counter(), "times": times}


async def level(url, conc, per_client, ptoks, gen, timeout, seed):
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=conc + 4)) as client:
        async def worker(c):
            out = []
            for i in range(per_client):
                out.append(await one(client, url, prompt_ids(seed * 100003 + c * 101 + i, ptoks), gen, timeout))
            return out

        t0 = time.perf_counter()
        res = [r for rs in await asyncio.gather(*(worker(c) for c in range(conc))) for r in rs]
        wall = time.perf_counter() - t0
    ok = [r for r in res if r["status"] == 200 and r["times"]]
    toks = sum(len(r["times"]) for r in ok)
    ttft = [r["times"][0] - r["t0"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    return {
        "concurrency": conc,
        "requests": len(res),
        "errors": len(res) - len(ok),
        "generated": toks,
        "wall_s": wall,
        "agg_tps": toks / wall if wall > 0 else 0.0,
        "ttft_p50_ms": pct(ttft, 50) * 1e3,
        "ttft_p99_ms": pct(ttft, 99) * 1e3,
        "itl_p50_ms": pct(itl, 50) * 1e3,
        "itl_p99_ms": pct(itl, 99) * 1e3,
    }


async def overload(url, n, ptoks, gen, timeout):
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 4)) as client:
        res = await asyncio.gather(*(one(client, url, prompt_ids(7000 + i, ptoks), gen, timeout) for i in range(n)))
    refused = [r for r in res if r["status"] == 429]
    done = [r for r in res if r["status"] == 200 and len(r["times"]) == gen]
    return {
        "fired": n,
        "refused_429": len(refused),
        "refused_max_ms": max((r["t1"] - r["t0"]) * 1e3 for r in refused) if refused else None,
        "completed": len(done),
        "other": n - len(refused) - len(done),
    }


async def prefix(url, p, timeout):
    base = prompt_ids(424242, p)
    out = []
    async with httpx.AsyncClient() as client:
        for i in range(2):
            r = await one(client, url, base + prompt_ids(99 + i, 8), 4, timeout)
            out.append((r["times"][0] - r["t0"]) * 1e3 if r["times"] else float("nan"))
    return {"prefix_tokens": p, "ttft_first_ms": out[0], "ttft_second_ms": out[1], "ratio": out[1] / out[0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--overload", type=int, default=0)
    ap.add_argument("--prefix-tokens", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    out = {"levels": []}
    # warm-up: one short request
    asyncio.run(level(a.url, 1, 1, 16, 8, a.timeout, 12345))
    for c in [int(x) for x in a.concurrency.split(",") if x]:
        r = asyncio.run(level(a.url, c, a.requests_per_client, a.prompt_tokens, a.gen_tokens, a.timeout, a.seed))
        print(json.dumps(r), flush=True)
        out["levels"].append(r)
    if a.overload:
        out["overload"] = asyncio.run(overload(a.url, a.overload, a.prompt_tokens, 32, a.timeout))
        print(json.dumps(out["overload"]), flush=True)
    if a.prefix_tokens:
        out["prefix"] = asyncio.run(prefix(a.url, a.prefix_tokens, a.timeout))
        print(json.dumps(out["prefix"]), flush=True)
    with open(a.json, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
