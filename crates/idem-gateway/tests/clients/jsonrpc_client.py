"""A plain JSON-RPC 2.0 client (`jsonrpcclient` builds the calls and
parses the answers, `requests` sends them) that retries: for each of N
payments it sends `payments.create` with its key in
`params.idempotency_key` twice at once and once more, each time with a
new call id, then once with another amount. Then a batch holding a
payment, a batch of reads and a notification, and a notification alone.
Prints a JSON report.

    python3 jsonrpc_client.py URL N
"""

import concurrent.futures
import itertools
import json
import sys
import time

import requests
from jsonrpcclient import Error, Ok, parse, request

URL, N = sys.argv[1], int(sys.argv[2])
IDS = itertools.count(1)
session = requests.Session()
session.headers["Authorization"] = "Bearer rpc-client"
report = {"calls": 0, "answers": {}, "refused": {}, "ids_matched": True}


def post(body):
    return session.post(URL, json=body, timeout=30)


def create(n, cents):
    """Calls until the answer is not "in progress"; the parsed answer."""
    while True:
        call = request("payments.create", params={"order": f"order-{n}", "cents": cents,
                                                  "idempotency_key": f"rpc-{n}"}, id=next(IDS))
        report["calls"] += 1
        answer = parse(post(call).json())
        if answer.id != call["id"]:
            report["ids_matched"] = False
        if isinstance(answer, Error):
            report["refused"][str(answer.code)] = report["refused"].get(str(answer.code), 0) + 1
            if answer.code == -31004:
                time.sleep(0.2)
                continue
            return answer.code
        report["answers"].setdefault(f"rpc-{n}", []).append(answer.result["run"])
        return answer.result["run"]


def payment(n):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: create(n, 100 + n), range(2)))
    create(n, 100 + n)
    assert create(n, 101 + n) == -31003


with concurrent.futures.ThreadPoolExecutor(4) as pool:
    list(pool.map(payment, range(N)))

batch = [request("payments.count"), request("payments.create",
         params={"order": "batched", "cents": 1, "idempotency_key": "rpc-batch"})]
refused = parse(post(batch).json())
report["batch_with_payment"] = refused.code if isinstance(refused, Error) else "answered"
reads = post([request("payments.count"), {"jsonrpc": "2.0", "method": "ping"}]).json()
report["batch_of_reads"] = [r.result for r in parse(reads) if isinstance(r, Ok)]
alone = post({"jsonrpc": "2.0", "method": "ping"})
report["notification"] = [alone.status_code, alone.text]
json.dump(report, sys.stdout)
