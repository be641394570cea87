#!/usr/bin/env python3
"""The DynamoDB store's floor: the emulator's own round trips for the
writes a unique key needs, with nothing around them.

    python3 bench/dynamodb-floor.py [SECONDS] [CLIENTS...]

Against the DynamoDB-compatible server at DYNAMODB_ENDPOINT (default the
moto server scripts/services.sh starts, http://127.0.0.1:8000), in a
table of its own (idem_bench_raw, deleted at the end), each client a
thread with a boto3 client of its own (boto3 comes with moto):

  reserve           one conditional PutItem (attribute_not_exists), as a
                    reservation;
  reserve_complete  that PutItem, then the UpdateItem that records the
                    answer, conditional on owner and attempt.

One line per script and client count: operations per second and the
mean and median latency of one operation. The figures are an emulator's
(moto, a Python server): they bound what a gateway on the same emulator
can do, and say nothing of DynamoDB itself.
"""

import os
import statistics
import sys
import threading
import time
import uuid

import boto3

ENDPOINT = os.environ.get("DYNAMODB_ENDPOINT", "http://127.0.0.1:8000")
TABLE = "idem_bench_raw"


def client():
    return boto3.client(
        "dynamodb",
        endpoint_url=ENDPOINT,
        region_name="us-east-1",
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
    )


def reserve(c, key):
    c.put_item(
        TableName=TABLE,
        Item={
            "pk": {"S": f"bench\x1fPOST /v1/payments\x1f{key}"},
            "fingerprint": {"B": b"\xab" * 32},
            "state": {"S": "processing"},
            "owner": {"B": b"\xcd" * 16},
            "attempt": {"N": "1"},
            "created_at": {"N": str(int(time.time() * 1000))},
            "expires_at": {"N": str(int(time.time() * 1000) + 86_400_000)},
            "locked_until": {"N": str(int(time.time() * 1000) + 30_000)},
        },
        ConditionExpression="attribute_not_exists(pk)",
    )


def complete(c, key):
    c.update_item(
        TableName=TABLE,
        Key={"pk": {"S": f"bench\x1fPOST /v1/payments\x1f{key}"}},
        UpdateExpression="SET #s = :done, response_status = :status, response_body = :body, expires_at = :exp",
        ConditionExpression="#o = :owner AND attempt = :attempt",
        ExpressionAttributeNames={"#s": "state", "#o": "owner"},
        ExpressionAttributeValues={
            ":done": {"S": "completed"},
            ":status": {"N": "201"},
            ":body": {"B": b"ok"},
            ":exp": {"N": str(int(time.time() * 1000) + 86_400_000)},
            ":owner": {"B": b"\xcd" * 16},
            ":attempt": {"N": "1"},
        },
    )


SCRIPTS = {
    "reserve": (reserve,),
    "reserve_complete": (reserve, complete),
}


def point(name, clients, seconds):
    latencies = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def run():
        c = client()
        mine = []
        while time.monotonic() < stop:
            key = uuid.uuid4().hex
            start = time.perf_counter()
            for step in SCRIPTS[name]:
                step(c, key)
            mine.append(time.perf_counter() - start)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=run) for _ in range(clients)]
    began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - began
    print(
        f"dynamodb {name:<17} clients={clients:<4} tps={len(latencies) / took:.1f} "
        f"latency_ms={1000 * statistics.fmean(latencies):.3f} p50_ms={1000 * statistics.median(latencies):.3f}",
        flush=True,
    )


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    clients = [int(c) for c in sys.argv[2:]] or [1, 16, 64]
    c = client()
    try:
        c.delete_table(TableName=TABLE)
    except c.exceptions.ResourceNotFoundException:
        pass
    c.create_table(
        TableName=TABLE,
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    try:
        for name in SCRIPTS:
            for n in clients:
                point(name, n, seconds)
    finally:
        c.delete_table(TableName=TABLE)
    print(
        f"dynamodb command: python3 bench/dynamodb-floor.py {seconds:g} {' '.join(map(str, clients))} "
        f"(boto3 against {ENDPOINT}, an emulator: moto)"
    )


if __name__ == "__main__":
    main()
