"""A GraphQL client that retries (`gql` over `requests`: gql sends every
call and parses every answer, the gateway's refusals too). For each of
N payments it sends the `Create` mutation with one idempotency key
(`gql-pay-N`, in the `Idempotency-Key` header for even N, in the
`idempotencyKey` variable for odd N)

* three times at once;
* for every fourth, under a second key, once with a read time-out
  shorter than the payment (the answer is dropped), then again until it
  gets the answer;
* once written differently (spacing, a comment, commas, the variables
  in another order);
* once in a document that also holds a query, picked by its operation
  name; then the query, by its name, with the same key;
* once with another amount, which must be refused.

A call refused as in progress is sent again after a quarter of its
`retry_after`. Then a batch holding the mutation, and a count of the
ledger. Prints a JSON report: calls sent, the ids each key got, refusals
by code, time-outs, queries answered, the batch's status and code, the
ledger's length, answers marked replayed.

    python3 graphql_client.py URL PAYMENTS
"""

import concurrent.futures
import json
import sys
import threading
import time

import requests
from gql import Client, GraphQLRequest
from gql.transport.exceptions import TransportConnectionFailed, TransportQueryError
from gql.transport.requests import RequestsHTTPTransport

URL, PAYMENTS = sys.argv[1], int(sys.argv[2])
AUTH = {"Authorization": "Bearer graphql-1"}
IN_PROGRESS = "IDEMPOTENCY_REQUEST_IN_PROGRESS"
TIMEOUT, DROPPED = 30, (5, 0.2)
LOCK = threading.Lock()
report = {"calls": 0, "answers": {}, "refused": {}, "timeouts": 0, "queries_passed": 0,
          "replayed": 0}

CREATE = """mutation Create($order: String!, $cents: Int!, $idempotencyKey: String) {
  createPayment(order: $order, cents: $cents, idempotencyKey: $idempotencyKey) { id order cents run }
}"""

# The same operation as CREATE, as another hand would write it.
RESPELLED = """
# Charge the order (once, whatever the retries).
mutation   Create( $order : String! , $cents : Int! , $idempotencyKey : String , )
{
    createPayment( order : $order , cents : $cents , idempotencyKey : $idempotencyKey , ) {
        id , order ,
        cents , run ,
    }
}
"""

TWO_OPERATIONS = """query Look($order: String!) { payment(order: $order) { id } }
mutation Create($order: String!, $cents: Int!, $idempotencyKey: String) {
  createPayment(order: $order, cents: $cents, idempotencyKey: $idempotencyKey) { id order cents run }
}"""

SLOW = """mutation Create($order: String!, $cents: Int!, $idempotencyKey: String, $delayMs: Int) {
  createPayment(order: $order, cents: $cents, idempotencyKey: $idempotencyKey, delayMs: $delayMs) { id order cents run }
}"""


class Verbatim(GraphQLRequest):
    """A request sent as written: gql prints the parsed document again
    before sending it, which would send every spelling alike."""

    @property
    def payload(self):
        return dict(super().payload, query=self.document.loc.source.body)


def count(field, code=None):
    with LOCK:
        if code is None:
            report[field] += 1
        else:
            report[field][code] = report[field].get(code, 0) + 1


def call(key, variables, header, document=CREATE, operation="Create", timeout=TIMEOUT):
    """Sends the request until the answer is not "in progress"; the
    answer's data, the refusal's code, or None when the client stopped
    waiting for the answer."""
    headers = dict(AUTH, **({"Idempotency-Key": key} if header else {}))
    while True:
        # A transport a call: its `response_headers` are this answer's.
        transport = RequestsHTTPTransport(URL, headers=headers, timeout=timeout)
        count("calls")
        try:
            data = Client(transport=transport).execute(
                Verbatim(document, variable_values=variables, operation_name=operation))
        except TransportQueryError as e:
            extensions = (e.errors or [{}])[0].get("extensions") or {}
            code = extensions.get("code")
            if code is None:
                raise RuntimeError(f"{key}: {operation} answered errors {e.errors}") from e
            count("refused", code)
            if code == IN_PROGRESS:
                time.sleep(extensions.get("retry_after", 1) / 4)
                continue
            return code
        except TransportConnectionFailed as e:
            if timeout == DROPPED and isinstance(e.__cause__, requests.ReadTimeout):
                count("timeouts")
                return None
            raise RuntimeError(f"{key}: {operation} was not answered: {e}") from e
        if transport.response_headers.get("Idempotency-Replayed") == "true":
            count("replayed")
        return data


def charge(key, variables, header, document=CREATE, operation="Create", timeout=TIMEOUT):
    """`call`, keeping the id of the payment answered under its key."""
    answer = call(key, variables, header, document, operation, timeout)
    if isinstance(answer, dict):
        with LOCK:
            report["answers"].setdefault(key, []).append(answer["createPayment"]["id"])
    return answer


def payment(n):
    key, header = f"gql-pay-{n}", n % 2 == 0
    args = {"order": f"order-{n}", "cents": 100 + n}
    if not header:
        args["idempotencyKey"] = key
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda _: charge(key, args, header), range(3)))
    if n % 4 == 0:
        # The first answer is dropped: the client gives up on it, then
        # asks again with the same key (the call as first sent).
        other = f"{key}-slow"
        slow = dict(args, order=f"order-{n}-slow", delayMs=600)
        if not header:
            slow["idempotencyKey"] = other
        if charge(other, slow, header, SLOW, timeout=DROPPED) is None:
            charge(other, slow, header, SLOW)
    charge(key, dict(reversed(list(args.items()))), header, RESPELLED)
    charge(key, args, header, TWO_OPERATIONS, "Create")
    if isinstance(call(key, args, header, TWO_OPERATIONS, "Look"), dict):
        count("queries_passed")
    charge(key, dict(args, cents=args["cents"] + 1), header)


with concurrent.futures.ThreadPoolExecutor(8) as pool:
    list(pool.map(payment, range(PAYMENTS)))

batch = [{"query": "query { payments }"},
         {"query": CREATE, "operationName": "Create",
          "variables": {"order": "batched", "cents": 1}}]
count("calls")
answer = requests.post(URL, json=batch, headers=dict(AUTH, **{"Idempotency-Key": "gql-batch-1"}),
                       timeout=TIMEOUT)
try:
    errors = answer.json().get("errors") or [{}]
except ValueError:
    errors = [{}]
report["batch_with_mutation"] = [answer.status_code, (errors[0].get("extensions") or {}).get("code")]
report["ledger_length"] = call(None, None, False, "query { payments }", None)["payments"]
json.dump(report, sys.stdout)
