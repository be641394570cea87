"""An MCP server over Streamable HTTP (the official `mcp` SDK) whose tool
moves money: every run of `charge` appends one line to the ledger file,
whatever the call's key, so a second run of one call is a second line.

    python3 mcp_server.py PORT LEDGER [json]   # json: answers in JSON, not SSE

`charge(order, cents, delay_ms)` reports progress (an SSE event), waits
`delay_ms`, charges, and answers what it charged and the run's number.
`ledger()` (read-only, never protected) answers the ledger's lines.
"""

import asyncio
import sys

from mcp.server.mcpserver import Context, MCPServer

PORT, LEDGER = int(sys.argv[1]), sys.argv[2]
JSON = "json" in sys.argv[3:]
mcp = MCPServer("payments")
RUNS = {"n": 0}


@mcp.tool()
async def charge(order: str, cents: int, ctx: Context, delay_ms: int = 0) -> str:
    """Charges `cents` for `order`: a side effect per run."""
    await ctx.report_progress(0, 1, "charging")
    await asyncio.sleep(delay_ms / 1000)
    RUNS["n"] += 1
    with open(LEDGER, "a") as f:
        f.write(f"{order} {cents}\n")
    return f"charged {order} {cents} (run {RUNS['n']})"


@mcp.tool()
def ledger() -> str:
    """The charges made so far, one per line."""
    with open(LEDGER) as f:
        return f.read()


if __name__ == "__main__":
    open(LEDGER, "a").close()
    mcp.run(transport="streamable-http", host="127.0.0.1", port=PORT,
            stateless_http=False, json_response=JSON)
