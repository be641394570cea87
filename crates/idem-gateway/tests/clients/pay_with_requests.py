#!/usr/bin/env python3
"""Pays N payments through a gateway with Python `requests` and urllib3's
`Retry`, configured as a careful client would: POST retried, read time-outs
retried, 409 and 5xx retried, `Retry-After` respected. Each payment has its
own Idempotency-Key, kept across its retries (the point of the key).

Prints one JSON object: how many payments ended on which status, and how
many requests urllib3 sent in all.

Usage: pay_with_requests.py URL PAYMENTS [--read-timeout S] [--total N]
"""
import argparse
import concurrent.futures
import json
import sys
import threading
import uuid

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry


class CountingRetry(Retry):
    """urllib3's Retry, counting the retries it makes."""

    lock = threading.Lock()
    retries = 0

    def increment(self, *args, **kwargs):
        with CountingRetry.lock:
            CountingRetry.retries += 1
        return super().increment(*args, **kwargs)


def session(total):
    retry = CountingRetry(
        total=total,
        connect=total,
        read=total,
        status=total,
        backoff_factor=0.1,
        backoff_max=2,
        status_forcelist=[409, 502, 503, 504],
        allowed_methods=None,  # every method, POST included
        respect_retry_after_header=True,
        raise_on_status=False,
    )
    s = requests.Session()
    adapter = HTTPAdapter(max_retries=retry, pool_maxsize=32)
    s.mount("http://", adapter)
    return s


def main():
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("payments", type=int)
    p.add_argument("--read-timeout", type=float, default=1.0)
    p.add_argument("--total", type=int, default=10)
    p.add_argument("--workers", type=int, default=16)
    a = p.parse_args()
    local = threading.local()

    def pay(i):
        if not hasattr(local, "s"):
            local.s = session(a.total)
        key = f"pay-{uuid.uuid4()}"
        try:
            r = local.s.post(
                f"{a.url}/v1/payments",
                json={"amount_cents": 100 + i, "currency": "eur"},
                headers={"Idempotency-Key": key, "Authorization": "Bearer sk_test_clients"},
                timeout=(2.0, a.read_timeout),
            )
            return key, r.status_code, r.headers.get("Idempotent-Replayed") == "true"
        except requests.RequestException as e:
            return key, type(e).__name__, False

    status = {}
    keys = {}
    replayed = 0
    with concurrent.futures.ThreadPoolExecutor(a.workers) as pool:
        for key, code, was_replayed in pool.map(pay, range(a.payments)):
            status[str(code)] = status.get(str(code), 0) + 1
            keys[key] = code
            replayed += was_replayed
    json.dump(
        {
            "payments": a.payments,
            "status": status,
            "replayed": replayed,
            "retries": CountingRetry.retries,
            "keys": keys,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
