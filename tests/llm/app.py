#!/usr/bin/env python3
"""One app calling an LLM API through its official SDK, for usher's fleet tests.

The app is what a service using OpenAI's or Anthropic's Python SDK does: an
AsyncOpenAI or AsyncAnthropic client whose base_url is the sidecar's listener
(or the API itself), the SDK's default retries (2, honouring Retry-After)
unless --max-retries says otherwise, calls arriving at a seeded Poisson or
fixed rate, a share of them streamed as the SDK streams by default
(`stream=True`, no `stream_options`), and of those an optional share that asks
for usage itself (`stream_options={"include_usage": True}`).

It writes one JSON line per call to --out: times (Unix seconds: start,
first_chunk, end), outcome, final status, every attempt's status, what the
app received (events, whether any chunk had usage or empty choices, the usage
it saw), each 429 attempt's `retry-after`, body (its first 400 bytes) and
whether usher sent it (usher's refusals carry a `ratelimit-policy` header,
the APIs' do not), and the
last attempt's body as the app received it: its length, an FNV-1a 64-bit
digest (hex) and whether it ended with `data: [DONE]`. With
--keep-bodies the body itself is kept too. Every call sends `x-call-id`,
which the stand-in upstreams record, so a test can pair each line with what
the upstream sent.

Outcomes: ok; disconnected (the app closed a stream after --disconnect-after
events, as --disconnect-share says); http_error (the SDK raised for a status,
after its retries); timeout; connection_error; error (anything else, with
its repr); abandoned (still running --grace seconds after the last arrival).
The run is bounded: arrivals stop after --duration seconds or --calls calls.
"""

import argparse
import asyncio
import json
import random
import sys
import time

import httpx2


def fnv1a64(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


class TeeStream(httpx2.AsyncByteStream):
    """Passes a response body through, keeping a copy of its bytes."""

    def __init__(self, inner, sink: bytearray):
        self.inner = inner
        self.sink = sink

    async def __aiter__(self):
        async for part in self.inner:
            self.sink.extend(part)
            yield part

    async def aclose(self):
        await self.inner.aclose()


class Tee(httpx2.AsyncHTTPTransport):
    """Records every attempt's status and body bytes, by the request's x-call-id."""

    def __init__(self):
        super().__init__()
        self.attempts = {}

    async def handle_async_request(self, request):
        response = await super().handle_async_request(request)
        attempt = {
            "status": response.status_code,
            "body": bytearray(),
            "retry_after": response.headers.get("retry-after"),
            # usher's refusals carry RateLimit-Policy; the APIs' do not.
            "usher": "ratelimit-policy" in response.headers,
        }
        self.attempts.setdefault(request.headers.get("x-call-id"), []).append(attempt)
        if response.status_code == 429:
            # The SDK closes a refusal it retries unread: read it here, so every refusal's body is kept.
            body = b"".join([part async for part in response.stream])
            await response.stream.aclose()
            attempt["body"].extend(body)
            response.stream = httpx2.ByteStream(body)
        else:
            response.stream = TeeStream(response.stream, attempt["body"])
        return response


WORDS = "please summarise the lease table for each sidecar in plain words".split()


def prompt(rng: random.Random, lo: int, hi: int) -> str:
    n = rng.randint(lo, hi)
    text = ""
    while len(text) < n:
        text += rng.choice(WORDS) + " "
    return text[:n]


async def chat(client, rec, kw, disconnect_after):
    """A chat completion, read as an app reads it."""
    if not rec["streamed"]:
        r = await client.chat.completions.create(**kw)
        rec["usage"] = r.usage.model_dump() if r.usage else None
        return
    stream = await client.chat.completions.create(**kw)
    async for chunk in stream:
        event(rec)
        if chunk.usage is not None:
            rec["usage_chunk"] = True
            rec["usage"] = chunk.usage.model_dump()
        if not chunk.choices:
            # An app reading choices[0] of every chunk would crash here.
            rec["empty_choices"] = True
        if disconnect_after and rec["events"] >= disconnect_after:
            await stream.close()
            rec["outcome"] = "disconnected"
            return


async def responses(client, rec, kw, disconnect_after):
    """A Responses API call; streamed, its usage is in response.completed."""
    if not rec["streamed"]:
        r = await client.responses.create(**kw)
        rec["usage"] = r.usage.model_dump() if r.usage else None
        return
    stream = await client.responses.create(**kw)
    async for ev in stream:
        event(rec)
        if ev.type in ("response.completed", "response.incomplete") and ev.response.usage:
            rec["usage"] = ev.response.usage.model_dump()
        if disconnect_after and rec["events"] >= disconnect_after:
            await stream.close()
            rec["outcome"] = "disconnected"
            return


async def messages(client, rec, kw, disconnect_after):
    """An Anthropic message; streamed, input comes first and output last."""
    if not rec["streamed"]:
        r = await client.messages.create(**kw)
        rec["usage"] = {"input_tokens": r.usage.input_tokens, "output_tokens": r.usage.output_tokens}
        return
    stream = await client.messages.create(**kw)
    usage = {}
    async for ev in stream:
        event(rec)
        if ev.type == "message_start":
            usage["input_tokens"] = ev.message.usage.input_tokens
        elif ev.type == "message_delta":
            usage["output_tokens"] = ev.usage.output_tokens
        if disconnect_after and rec["events"] >= disconnect_after:
            await stream.close()
            rec["outcome"] = "disconnected"
            return
    rec["usage"] = usage


def event(rec):
    if rec["events"] == 0:
        rec["first_chunk"] = time.time()
    rec["events"] += 1


def request(args, rng, call_id):
    """The call's SDK arguments and its record."""
    streamed = rng.random() < args.stream_share
    asked = streamed and args.api == "chat" and rng.random() < args.usage_share
    disconnect = streamed and rng.random() < args.disconnect_share
    text = prompt(rng, args.prompt_chars[0], args.prompt_chars[1])
    kw = {"model": args.model, "extra_headers": {"x-call-id": call_id}}
    if args.api == "chat":
        kw["messages"] = [{"role": "user", "content": text}]
        if args.max_tokens:
            kw["max_tokens"] = args.max_tokens
        if asked:
            kw["stream_options"] = {"include_usage": True}
    elif args.api == "responses":
        kw["input"] = text
        if args.max_tokens:
            kw["max_output_tokens"] = args.max_tokens
    else:
        kw["messages"] = [{"role": "user", "content": text}]
        kw["max_tokens"] = args.max_tokens or 1024
    if streamed:
        kw["stream"] = True
    rec = {
        "id": call_id,
        "api": args.api,
        "streamed": streamed,
        "asked_usage": asked,
        "prompt_chars": len(text),
        "events": 0,
        "usage_chunk": False,
        "empty_choices": False,
        "usage": None,
        "first_chunk": None,
    }
    return kw, rec, (args.disconnect_after if disconnect else 0)


async def one_call(args, client, tee, rng, n, sdk):
    call_id = f"{args.name}-{n}"
    kw, rec, disconnect_after = request(args, rng, call_id)
    rec["start"] = time.time()
    rec["outcome"] = "ok"
    run = {"chat": chat, "responses": responses, "messages": messages}[args.api]
    try:
        await run(client, rec, kw, disconnect_after)
    except sdk.APIStatusError as e:
        rec["outcome"] = "http_error"
        rec["error"] = str(e)[:500]
    except sdk.APITimeoutError:
        rec["outcome"] = "timeout"
    except sdk.APIConnectionError as e:
        rec["outcome"] = "connection_error"
        rec["error"] = repr(e)[:500]
    except asyncio.CancelledError:
        rec["outcome"] = "abandoned"
    except Exception as e:  # noqa: BLE001 - every failure is a record, not a crash
        rec["outcome"] = "error"
        rec["error"] = repr(e)[:500]
    rec["end"] = time.time()
    attempts = tee.attempts.pop(call_id, [])
    rec["attempts"] = len(attempts)
    rec["statuses"] = [a["status"] for a in attempts]
    rec["status"] = attempts[-1]["status"] if attempts else None
    rec["refusals"] = [
        {"retry_after": a["retry_after"], "usher": a["usher"], "body": bytes(a["body"][:400]).decode("utf-8", "replace")}
        for a in attempts
        if a["status"] == 429
    ]
    body = bytes(attempts[-1]["body"]) if attempts else b""
    rec["bytes"] = len(body)
    rec["digest"] = fnv1a64(body)
    rec["done"] = body.rstrip(b"\r\n").endswith(b"data: [DONE]")
    if args.keep_bodies:
        rec["body"] = body.decode("utf-8", "replace")
    return rec


def client_for(args, tee):
    if args.api == "messages":
        import anthropic as sdk

        make = sdk.AsyncAnthropic
        key = "sk-ant-test"
    else:
        import openai as sdk

        make = sdk.AsyncOpenAI
        key = "sk-test"
    kw = {"api_key": key, "base_url": args.base_url, "timeout": args.timeout}
    kw["http_client"] = sdk.DefaultAsyncHttpxClient(transport=tee)
    if args.max_retries is not None:
        kw["max_retries"] = args.max_retries
    return make(**kw), sdk


async def main(args):
    tee = Tee()
    client, sdk = client_for(args, tee)
    arrivals = random.Random(args.seed)
    calls = random.Random(args.seed * 7919 + 1)
    start_at = args.start_at
    if start_at == "stdin":
        # Loaded: say so, and wait to be told when to start (Unix seconds, a line on stdin).
        print("ready", flush=True)
        start_at = (await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)).strip()
        if not start_at:
            sys.exit(f"{args.name}: stdin closed before it said when to start")
    if start_at:
        await asyncio.sleep(max(0.0, float(start_at) - time.time()))
    start = time.monotonic()
    tasks = []
    at = 0.0
    n = 0
    while n < args.calls:
        at += arrivals.expovariate(args.rate) if args.arrivals == "poisson" else 1.0 / args.rate
        if at >= args.duration:
            break
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        tasks.append(asyncio.create_task(one_call(args, client, tee, calls, n, sdk)))
        n += 1
    done, pending = await asyncio.wait(tasks, timeout=args.grace) if tasks else (set(), set())
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending)
    with open(args.out, "w") as out:
        for t in tasks:
            out.write(json.dumps(t.result()) + "\n")
    outcomes = {}
    for t in tasks:
        o = t.result()["outcome"]
        outcomes[o] = outcomes.get(o, 0) + 1
    print(f"{args.name}: {n} calls: {outcomes}", file=sys.stderr)
    await client.close()


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--api", choices=["chat", "responses", "messages"], required=True)
    p.add_argument("--base-url", required=True, help="http://HOST:PORT/v1 (OpenAI) or http://HOST:PORT (Anthropic)")
    p.add_argument("--out", required=True, help="where the JSON lines go")
    p.add_argument("--name", default="app", help="prefixes each call's x-call-id")
    p.add_argument("--model", default="gpt-4o-mini")
    p.add_argument("--rate", type=float, default=0.5, help="calls a second")
    p.add_argument("--arrivals", choices=["poisson", "fixed"], default="poisson")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--calls", type=int, default=10_000, help="at most this many calls")
    p.add_argument("--grace", type=float, default=30.0, help="seconds to wait for calls after the last arrival")
    p.add_argument(
        "--start-at",
        default="",
        help="Unix time when the arrivals' clock starts; `stdin`: print `ready` once loaded, then read it from stdin",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--stream-share", type=float, default=0.0)
    p.add_argument("--usage-share", type=float, default=0.0, help="of streamed chat calls, those asking for usage")
    p.add_argument("--disconnect-share", type=float, default=0.0, help="of streamed calls, those the app leaves")
    p.add_argument("--disconnect-after", type=int, default=2, help="events read before leaving")
    p.add_argument("--max-tokens", type=int, default=0, help="the output limit sent (0: none; messages: 1024)")
    p.add_argument("--prompt-chars", type=lambda s: tuple(int(x) for x in s.split(":")), default=(40, 400))
    p.add_argument("--max-retries", type=int, default=None, help="default: the SDK's")
    p.add_argument("--timeout", type=float, default=60.0, help="the SDK's timeout per attempt")
    p.add_argument("--keep-bodies", action="store_true")
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse()))
