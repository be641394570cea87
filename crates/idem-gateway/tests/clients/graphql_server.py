"""A GraphQL payments service (a `strawberry` schema served over HTTP by
`uvicorn`, at `/graphql`) that does not deduplicate: every
`createPayment` appends one line to the ledger file.

    python3 graphql_server.py PORT LEDGER

Mutations: `createPayment(order, cents, idempotencyKey, delayMs)` waits
`delayMs`, charges and answers the payment (a fresh `id`, and `run`, the
ledger's length after it); `failPayment(order)` writes its line, then
fails (a field error after the side effect: `data` is null). Queries:
`payments` (the ledger's length) and `payment(order)` (the order's last
charge, or null). Batching is off, and a JSON array is answered `400`
here whatever strawberry would make of it. No GraphiQL.
"""

import asyncio
import json
import sys
import uuid
from typing import Optional

import strawberry
import uvicorn
from strawberry.asgi import GraphQL

PORT, LEDGER = int(sys.argv[1]), sys.argv[2]
LOCK = asyncio.Lock()


class Declined(Exception):
    """The failure `failPayment` is asked for."""


@strawberry.type
class Payment:
    id: strawberry.ID
    order: str
    cents: int
    run: int


def ledger():
    with open(LEDGER) as f:
        return f.read().splitlines()


def append(line):
    with open(LEDGER, "a") as f:
        f.write(line + "\n")
    return len(ledger())


@strawberry.type
class Query:
    @strawberry.field
    def payments(self) -> int:
        return len(ledger())

    @strawberry.field
    def payment(self, order: str) -> Optional[Payment]:
        # A failed attempt's line is not a payment: only charges count.
        for run, line in reversed(list(enumerate(ledger(), 1))):
            name, _, cents = line.rpartition(" ")
            if name == order and cents.isdigit():
                return Payment(id=strawberry.ID(f"ledger-{run}"), order=order,
                               cents=int(cents), run=run)
        return None


@strawberry.type
class Mutation:
    @strawberry.mutation
    async def create_payment(self, order: str, cents: int,
                             idempotency_key: Optional[str] = None,
                             delay_ms: int = 0) -> Payment:
        await asyncio.sleep(delay_ms / 1000)
        async with LOCK:
            run = append(f"{order} {cents}")
        return Payment(id=strawberry.ID(str(uuid.uuid4())), order=order, cents=cents, run=run)

    @strawberry.mutation
    async def fail_payment(self, order: str) -> Payment:
        async with LOCK:
            append(f"{order} failed")
        raise Declined(f"payment for {order} declined")


class Schema(strawberry.Schema):
    def process_errors(self, errors, execution_context=None):
        # A requested failure is the test's, not the service's: strawberry
        # would log its traceback.
        errors = [e for e in errors if not isinstance(e.original_error, Declined)]
        super().process_errors(errors, execution_context)


graphql = GraphQL(Schema(query=Query, mutation=Mutation), graphql_ide=None)


async def answer(send, status, body):
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    if scope["path"] != "/graphql":
        return await answer(send, 404, {"errors": [{"message": "not found"}]})
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    # The service runs one operation a request: a batch is refused before
    # strawberry sees it, so no setting of strawberry's can let one run.
    if body.lstrip().startswith(b"["):
        return await answer(send, 400, {"errors": [{"message": "batching is off"}]})
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    await graphql(scope, replay, send)


open(LEDGER, "a").close()
uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning", lifespan="off")
