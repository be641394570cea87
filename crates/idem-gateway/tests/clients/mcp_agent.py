"""An agent that retries tool calls, through the official `mcp` SDK's
client over Streamable HTTP, as agents do: for each of N payments it
calls `charge` with one idempotency key (in `_meta.idempotencyKey`)

* three times at once;
* once with a read time-out shorter than the tool (the answer is
  dropped), then again until it gets the answer;
* once more on a fresh session (a resumed run);
* once with changed arguments, which must be refused.

A call refused as in progress (JSON-RPC error -31004) is sent again after
its `retry_after`. Prints a JSON report: calls made, distinct keys, the
answers each key got (every one parsed by the SDK), refusals by code.

    python3 mcp_agent.py URL PAYMENTS MODE   # MODE: legacy (sessions, SSE) or auto
"""

import asyncio
import json
import sys

from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

URL, PAYMENTS, MODE = sys.argv[1], int(sys.argv[2]), sys.argv[3]
IN_PROGRESS, REUSED = -31004, -31003
report = {"calls": 0, "answers": {}, "refused": {}, "timeouts": 0}


def client():
    http = create_mcp_http_client(headers={"Authorization": "Bearer agent-1"})
    return Client(streamable_http_client(URL, http_client=http), mode=MODE)


def note(code):
    report["refused"][str(code)] = report["refused"].get(str(code), 0) + 1


async def call(c, key, args, timeout=None):
    """Calls `charge` until it gets an answer (not "in progress"); the
    answer's text, or the refusal's code."""
    while True:
        report["calls"] += 1
        try:
            r = await c.call_tool("charge", args, read_timeout_seconds=timeout,
                                  meta={"idempotencyKey": key})
        except MCPError as e:
            if e.code == IN_PROGRESS:
                note(e.code)
                await asyncio.sleep((e.data or {}).get("retry_after", 1) / 4)
                continue
            if timeout is not None and "timed out" in str(e).lower():
                report["timeouts"] += 1
                return None
            note(e.code)
            return e.code
        text = r.content[0].text
        report["answers"].setdefault(key, []).append(text)
        return text


async def payment(n):
    key = f"pay-{MODE}-{n}"
    args = {"order": f"order-{MODE}-{n}", "cents": 100 + n}
    async with client() as c:
        await asyncio.gather(*(call(c, key, args) for _ in range(3)))
        if n % 4 == 0:
            # The first answer is dropped: the agent gives up on it, then
            # asks again with the same key (the call as first sent).
            other = f"{key}-slow"
            slow = {"order": f"{args['order']}-slow", "cents": args["cents"], "delay_ms": 600}
            if await call(c, other, slow, timeout=0.2) is None:
                await call(c, other, slow)
        assert await call(c, key, dict(args, cents=args["cents"] + 1)) == REUSED
    # A resumed run: a new session, the same key.
    async with client() as c:
        await call(c, key, args)


async def main():
    for batch in range(0, PAYMENTS, 5):
        await asyncio.gather(*(payment(n) for n in range(batch, min(batch + 5, PAYMENTS))))
    json.dump(report, sys.stdout)


asyncio.run(main())
