"""Sends webhook deliveries signed by each provider's own code, as its
sender would: Standard Webhooks (`standardwebhooks`), Svix (`svix`),
Stripe (`stripe`), GitHub (`@octokit/webhooks-methods`, run by Node),
Slack (`slack_sdk`); Shopify publishes no signer, so its HMAC is made as
its docs say. Reads a plan on stdin, prints one result per delivery.

Plan: {"url": "http://127.0.0.1:8080", "node_dir": "…", "deliveries": [
  {"provider": "standard" | "svix" | "stripe" | "github" | "shopify" | "slack",
   "path": "/hooks/stripe", "secret": "…", "id": "evt_1", "body": "{…}",
   "ts_offset": 0,          # seconds added to the signing time
   "reencode": false,       # a proxy re-serialises the JSON after signing
   "headers": {…},          # extra headers (the test upstream's x-status)
   "wave": 0}               # deliveries of one wave are sent at once
]}

Result per delivery, in plan order: {"status": 201, "replayed": false,
"code": "webhook-signature-invalid" | null}.
"""

import base64
import concurrent.futures
import datetime
import hashlib
import hmac
import json
import os
import subprocess
import sys
import time

import requests
import slack_sdk.signature
import standardwebhooks.webhooks
import stripe
import svix.webhooks

GITHUB_SIGN = """
import { sign } from '@octokit/webhooks-methods';
let input = '';
for await (const chunk of process.stdin) input += chunk;
const out = [];
for (const { secret, payload } of JSON.parse(input)) out.push(await sign(secret, payload));
process.stdout.write(JSON.stringify(out));
"""


def github_signatures(node_dir, items):
    """Signs every GitHub payload with Octokit's `sign`, in one Node run."""
    if not items:
        return []
    out = subprocess.run(
        ["node", "--input-type=module", "-e", GITHUB_SIGN],
        cwd=node_dir, input=json.dumps(items), capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout)


def signed_headers(d, now, github_sig):
    """The headers the provider sends with delivery `d`."""
    ts = int(now + d.get("ts_offset", 0))
    body, secret, msg_id = d["body"], d["secret"], d["id"]
    p = d["provider"]
    if p == "standard":
        sig = standardwebhooks.webhooks.Webhook(secret).sign(
            msg_id, datetime.datetime.fromtimestamp(ts, tz=datetime.timezone.utc), body)
        return {"webhook-id": msg_id, "webhook-timestamp": str(ts), "webhook-signature": sig}
    if p == "svix":
        sig = svix.webhooks.Webhook(secret).sign(
            msg_id, datetime.datetime.fromtimestamp(ts, tz=datetime.timezone.utc), body)
        return {"svix-id": msg_id, "svix-timestamp": str(ts), "svix-signature": sig}
    if p == "stripe":
        # The event id is the body's "id"; the header is Stripe's own.
        return {"Stripe-Signature": stripe.WebhookSignature.generate_signature_header(body, secret, ts)}
    if p == "github":
        return {"X-Hub-Signature-256": github_sig, "X-GitHub-Delivery": msg_id,
                "X-GitHub-Event": "push"}
    if p == "shopify":
        mac = hmac.new(secret.encode(), body.encode(), hashlib.sha256).digest()
        return {"X-Shopify-Hmac-Sha256": base64.b64encode(mac).decode(),
                "X-Shopify-Webhook-Id": msg_id, "X-Shopify-Topic": "orders/create"}
    if p == "slack":
        sig = slack_sdk.signature.SignatureVerifier(secret).generate_signature(
            timestamp=str(ts), body=body)
        return {"X-Slack-Signature": sig, "X-Slack-Request-Timestamp": str(ts)}
    raise SystemExit(f"unknown provider {p}")


def reencoded(body):
    """What a proxy that parses and re-serialises JSON forwards."""
    return json.dumps(json.loads(body), indent=1, sort_keys=True)


def main():
    plan = json.load(sys.stdin)
    deliveries = plan["deliveries"]
    gh = [i for i, d in enumerate(deliveries) if d["provider"] == "github"]
    sigs = github_signatures(plan.get("node_dir"), [
        {"secret": deliveries[i]["secret"], "payload": deliveries[i]["body"]} for i in gh])
    github_sig = dict(zip(gh, sigs))
    results = [None] * len(deliveries)
    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=64)
    session.mount("http://", adapter)

    def send(i):
        d = deliveries[i]
        headers = {"Content-Type": "application/json"}
        headers.update(signed_headers(d, time.time(), github_sig.get(i)))
        headers.update(d.get("headers", {}))
        body = reencoded(d["body"]) if d.get("reencode") else d["body"]
        r = session.post(plan["url"] + d["path"], data=body.encode(), headers=headers, timeout=30)
        code = None
        if r.headers.get("Content-Type", "").startswith("application/problem+json"):
            code = r.json().get("code")
        results[i] = {"status": r.status_code,
                      "replayed": r.headers.get("Idempotent-Replayed") == "true",
                      "code": code}

    # A wave goes out from 32 threads in plan order: the copies of one
    # delivery placed side by side in a wave are sent at the same time.
    for wave in sorted({d.get("wave", 0) for d in deliveries}):
        with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
            list(pool.map(send, [i for i, d in enumerate(deliveries) if d.get("wave", 0) == wave]))
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
