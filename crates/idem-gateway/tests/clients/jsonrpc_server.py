"""A plain JSON-RPC 2.0 payments service (`jsonrpcserver`'s dispatch
behind the standard library's HTTP server) that does not deduplicate:
every `payments.create` appends one line to the ledger file.

    python3 jsonrpc_server.py PORT LEDGER

Methods: `payments.create(order, cents, idempotency_key)` charges and
answers the run's number; `payments.count()` answers the ledger's
length; `ping()` does nothing (sent as a notification). Batches and
notifications are JSON-RPC's: a notification's answer is `204`.
"""

import http.server
import sys
import threading

from jsonrpcserver import Success, dispatch, method

PORT, LEDGER = int(sys.argv[1]), sys.argv[2]
LOCK = threading.Lock()
RUNS = {"n": 0}


@method(name="payments.create")
def create(order, cents, idempotency_key=None):
    with LOCK:
        RUNS["n"] += 1
        with open(LEDGER, "a") as f:
            f.write(f"{order} {cents}\n")
        return Success({"order": order, "cents": cents, "run": RUNS["n"]})


@method(name="payments.count")
def count():
    with open(LEDGER) as f:
        return Success(len(f.read().splitlines()))


@method
def ping():
    return Success(None)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode()
        answer = dispatch(body)
        if not answer:
            self.send_response(204)
            self.end_headers()
            return
        data = answer.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


open(LEDGER, "a").close()
http.server.ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
