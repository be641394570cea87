"""A gRPC payments service (`grpcio`'s sync server, cleartext HTTP/2,
no protobuf: each message is a JSON object in the frame) that does not
deduplicate: every charge appends one line to the ledger file.

    python3 grpc_server.py PORT LEDGER

Service `pay.Payments`. Unary: `Create` (`order`, `cents`, `delay_ms`)
waits `delay_ms`, charges and answers the payment (a fresh `id`, and
`run`, the ledger's length after it), with the trailing metadata
`payment-id` and `x-run`; `Decline` writes its line, then fails
`INVALID_ARGUMENT` with the trailing metadata `decline-code`; `Flaky`
fails `UNAVAILABLE` the first time an order is asked for, writing
nothing, and is `Create` after that; `Crash` writes its line, then
fails `UNKNOWN`. Server streaming: `Watch` answers three messages.
"""

import concurrent.futures
import json
import sys
import threading
import time
import uuid

import grpc

PORT, LEDGER = int(sys.argv[1]), sys.argv[2]
LOCK = threading.Lock()
# The orders `Flaky` has failed once.
WARMED = set()


def append(line):
    """Writes one ledger line; the ledger's length after it."""
    with LOCK:
        with open(LEDGER, "a") as f:
            f.write(line + "\n")
        with open(LEDGER) as f:
            return len(f.read().splitlines())


def create(request, context):
    time.sleep(request.get("delay_ms", 0) / 1000)
    order, cents = request["order"], request["cents"]
    run = append(f"{order} {cents}")
    payment_id = uuid.uuid4().hex
    context.set_trailing_metadata((("payment-id", payment_id), ("x-run", str(run))))
    return {"id": payment_id, "order": order, "cents": cents, "run": run}


def decline(request, context):
    append(f"{request['order']} declined")
    context.set_trailing_metadata((("decline-code", "insufficient_funds"),))
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "card declined")


def flaky(request, context):
    with LOCK:
        first = request["order"] not in WARMED
        WARMED.add(request["order"])
    if first:
        context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
    return create(request, context)


def crash(request, context):
    append(f"{request['order']} crashed")
    context.abort(grpc.StatusCode.UNKNOWN, "crashed after charging")


def watch(request, context):
    for seq in range(3):
        yield {"seq": seq}


def encode(message):
    return json.dumps(message).encode()


UNARY = {"Create": create, "Decline": decline, "Flaky": flaky, "Crash": crash}
handlers = {name: grpc.unary_unary_rpc_method_handler(
    method, request_deserializer=json.loads, response_serializer=encode)
    for name, method in UNARY.items()}
handlers["Watch"] = grpc.unary_stream_rpc_method_handler(
    watch, request_deserializer=json.loads, response_serializer=encode)

open(LEDGER, "a").close()
server = grpc.server(concurrent.futures.ThreadPoolExecutor(16))
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pay.Payments", handlers),))
server.add_insecure_port(f"127.0.0.1:{PORT}")
server.start()
server.wait_for_termination()
