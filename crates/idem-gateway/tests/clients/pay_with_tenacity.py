#!/usr/bin/env python3
"""Pays N payments through a gateway as many applications retry: a
function that builds the request and sends it, wrapped in tenacity's
`@retry`. Each attempt is built anew, so each carries a fresh `sent_at`
stamp in its JSON body; the key travels in `X-Request-Id`, kept across
the attempts. Read time-outs, 409 and 5xx are retried with backoff.

Prints one JSON object: how many payments ended on which status, and how
many attempts were made in all.

Usage: pay_with_tenacity.py URL PAYMENTS [--read-timeout S] [--attempts N]
"""
import argparse
import concurrent.futures
import json
import sys
import threading
import time
import uuid

import requests
from tenacity import (
    retry,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    wait_exponential,
)

RETRIED = {409, 502, 503, 504}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("payments", type=int)
    p.add_argument("--read-timeout", type=float, default=1.0)
    p.add_argument("--attempts", type=int, default=10)
    p.add_argument("--workers", type=int, default=16)
    a = p.parse_args()
    local = threading.local()
    lock = threading.Lock()
    attempts = [0]

    def pay(i):
        if not hasattr(local, "s"):
            local.s = requests.Session()
        request_id = f"req-{uuid.uuid4()}"

        @retry(
            stop=stop_after_attempt(a.attempts),
            wait=wait_exponential(multiplier=0.1, max=2),
            retry=retry_if_exception_type(requests.RequestException)
            | retry_if_result(lambda r: r.status_code in RETRIED),
            retry_error_callback=lambda state: state.outcome.result()
            if not state.outcome.failed
            else state.outcome.exception(),
        )
        def attempt():
            with lock:
                attempts[0] += 1
            return local.s.post(
                f"{a.url}/v1/payments",
                json={"amount_cents": 100 + i, "currency": "eur", "sent_at": time.time()},
                headers={"X-Request-Id": request_id, "Authorization": "Bearer sk_test_clients"},
                timeout=(2.0, a.read_timeout),
            )

        r = attempt()
        if isinstance(r, Exception):
            return request_id, type(r).__name__
        return request_id, r.status_code

    status = {}
    with concurrent.futures.ThreadPoolExecutor(a.workers) as pool:
        for _, code in pool.map(pay, range(a.payments)):
            status[str(code)] = status.get(str(code), 0) + 1
    json.dump(
        {"payments": a.payments, "status": status, "attempts": attempts[0]},
        sys.stdout,
    )


if __name__ == "__main__":
    main()
