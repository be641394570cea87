"""A gRPC client that retries (`grpcio` over cleartext HTTP/2, no
protobuf: each message is a JSON object in the frame), with a service
config whose retry policy sends a call again on `UNAVAILABLE`. Every
call carries an idempotency key in the `idempotency-key` metadata. For
each of N payments it sends `Create` with one key (`grpc-pay-N`)

* three times at once;
* for every fourth, under a second key, once with a payment slower than
  the client waits (it cancels the call), then again until it gets the
  answer;
* once with another amount, which must be refused;

and, for every fourth from the second, `Decline` twice in turn under a
key of its own; for every fourth from the third, `Flaky` once under a
key and an order of its own (the service fails its first call
`UNAVAILABLE`, which the retry policy sends again); for the fourth,
`Crash` twice under one key (the first run's outcome is unknown, so the
second must be refused). A call refused as in progress is
sent again after a quarter of its `grpc-retry-pushback-ms`. Then
`Watch`, a server-streaming call. Prints a JSON report: calls sent, the
ids each key got, refusals by code, calls cancelled, the declines'
statuses and trailing metadata, the crash's code and its retry's,
messages streamed, answers whose `payment-id` trailer was not their id,
answers marked replayed.

    python3 grpc_client.py TARGET PAYMENTS
"""

import concurrent.futures
import json
import sys
import threading
import time

import grpc

TARGET, PAYMENTS = sys.argv[1], int(sys.argv[2])
AUTH = ("authorization", "Bearer grpc-1")
IN_PROGRESS = "idempotency-request-in-progress"
CANCEL_AFTER = 0.2
LOCK = threading.Lock()
report = {"calls": 0, "answers": {}, "refused": {}, "dropped": 0, "declines": {},
          "crash": None, "crash_retry": None, "stream": 0, "trailer_mismatch": 0,
          "replayed": 0}

SERVICE_CONFIG = {"methodConfig": [{
    "name": [{"service": "pay.Payments"}],
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "1s",
                    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
}]}
channel = grpc.insecure_channel(TARGET, options=[
    ("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(SERVICE_CONFIG))])


def encode(message):
    return json.dumps(message).encode()


METHODS = {name: channel.unary_unary(f"/pay.Payments/{name}", request_serializer=encode,
                                     response_deserializer=json.loads)
           for name in ("Create", "Decline", "Flaky", "Crash")}
WATCH = channel.unary_stream("/pay.Payments/Watch", request_serializer=encode,
                             response_deserializer=json.loads)


def count(field, code=None):
    with LOCK:
        if code is None:
            report[field] += 1
        else:
            report[field][code] = report[field].get(code, 0) + 1


def metadata(call):
    """All metadata of an answer: a trailers-only answer's, as the
    gateway's refusals are, is all trailing in grpcio, and a replay may
    carry its marker in the initial metadata."""
    return tuple(call.initial_metadata() or ()) + tuple(call.trailing_metadata() or ())


def value(pairs, key):
    return next((v for k, v in pairs if k == key), None)


def call(name, key, request):
    """Sends the call until it is not refused as in progress; the
    response and its call, or raises the `grpc.RpcError` it ended with
    (the gateway's other refusals among them)."""
    while True:
        count("calls")
        try:
            response, answered = METHODS[name].with_call(
                request, metadata=(AUTH, ("idempotency-key", key)))
        except grpc.RpcError as e:
            pairs = metadata(e)
            problem = value(pairs, "idem-problem")
            if e.code() == grpc.StatusCode.ABORTED and problem == IN_PROGRESS:
                count("refused", "ABORTED_IN_PROGRESS")
                time.sleep(max(int(value(pairs, "grpc-retry-pushback-ms") or 80) / 4, 20) / 1000)
                continue
            if problem is not None:
                count("refused", e.code().name)
            raise
        if value(answered.initial_metadata() or (), "idempotent-replayed") == "true":
            count("replayed")
        return response, answered


def charge(name, key, request):
    """`call`, keeping the id of the payment answered under its key; a
    call that fails is not expected here."""
    try:
        response, answered = call(name, key, request)
    except grpc.RpcError as e:
        raise RuntimeError(f"{key}: {name} {request} failed: {e.code().name} "
                           f"{e.details()!r} {metadata(e)}") from e
    with LOCK:
        report["answers"].setdefault(key, []).append(response["id"])
        if value(answered.trailing_metadata() or (), "payment-id") != response["id"]:
            report["trailer_mismatch"] += 1
    return response


def refused(name, key, request):
    """`call` of a call that must fail: its error (the Rust test checks
    the code), or None when it was answered."""
    try:
        call(name, key, request)
    except grpc.RpcError as e:
        return e
    return None


def payment(n):
    key = f"grpc-pay-{n}"
    args = {"order": f"order-{n}", "cents": 100 + n}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda _: charge("Create", key, args), range(3)))
    if n % 4 == 0:
        # The first answer is dropped: the client cancels the call before
        # the payment is done, then asks again with the same key.
        slow, slow_args = f"{key}-slow", dict(args, order=f"order-{n}-slow", delay_ms=600)
        count("calls")
        future = METHODS["Create"].future(slow_args, metadata=(AUTH, ("idempotency-key", slow)))
        time.sleep(CANCEL_AFTER)
        if not future.cancel():
            raise RuntimeError(f"{slow}: answered ({future.code().name}) within "
                               f"{CANCEL_AFTER}s, before the client could cancel it")
        count("dropped")
        charge("Create", slow, slow_args)
    error = refused("Create", key, dict(args, cents=args["cents"] + 1))
    if error is not None and value(metadata(error), "idem-problem") is None:
        count("refused", error.code().name)
    if n % 4 == 1:
        other = f"grpc-decline-{n}"
        for _ in range(2):
            error = refused("Decline", other, args)
            if error is None:
                raise RuntimeError(f"{other}: Decline was answered")
            # The gateway's own metadata (`idem-…`, `idempotent-…`) aside.
            kept = sorted([k, v] for k, v in error.trailing_metadata() or ()
                          if not k.startswith("idem"))
            with LOCK:
                report["declines"].setdefault(other, []).append(
                    [error.code().name, error.details(), kept])
    if n % 4 == 2:
        # An order of its own: each ledger line is one payment's.
        charge("Flaky", f"grpc-flaky-{n}", dict(args, order=f"order-{n}-flaky"))
    if n == 3:
        error = refused("Crash", "grpc-crash-3", args)
        report["crash"] = None if error is None else error.code().name
        error = refused("Crash", "grpc-crash-3", args)
        if error is not None:
            report["crash_retry"] = [error.code().name, value(metadata(error), "idem-problem")]


with concurrent.futures.ThreadPoolExecutor(8) as pool:
    list(pool.map(payment, range(PAYMENTS)))

count("calls")
report["stream"] = sum(1 for _ in WATCH({}, metadata=(AUTH,)))
channel.close()
json.dump(report, sys.stdout)
