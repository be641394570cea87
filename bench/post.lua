-- POST a small JSON payment; with IDEM_KEYS=unique a fresh Idempotency-Key
-- per request, in order (`<tag>-<thread>-<n>`); with IDEM_KEYS=uuid a fresh
-- one in no order, shaped as a version-4 UUID, as most clients make them;
-- with IDEM_KEYS=replay one of IDEM_REPLAY_KEYS warmed keys; with
-- IDEM_KEYS=signed-unique or signed-replays a Stripe-signed delivery from
-- the file IDEM_DELIVERIES (lines `id<TAB>Stripe-Signature`, made by
-- bench/ab), its id also sent as the Idempotency-Key so that a plain keyed
-- route and a webhook route get the same requests: in order per thread,
-- or at random among the file's; with IDEM_KEYS=rpc-unique or
-- rpc-replays a JSON-RPC call to /rpc keyed as unique or replay are;
-- with IDEM_KEYS=gql-unique or gql-replays a GraphQL mutation to
-- /graphql keyed the same way; otherwise no key (pass-through).
local mode = os.getenv("IDEM_KEYS") or "none"
local tag = os.getenv("IDEM_RUN_TAG") or tostring(os.time())
local replay_keys = tonumber(os.getenv("IDEM_REPLAY_KEYS") or "100")
local threads = 0
local counter = 0
local body = '{"amount_cents":100,"currency":"EUR","payment_method_id":"pm_card_visa"}'
-- The GraphQL mutation of the gql-* scenarios (bench/ab's GQL_BODY).
local mutation = '{"query":"mutation Create($amount: Int!, $currency: String!) { createPayment(amountCents: $amount, currency: $currency, paymentMethodId: \\"pm_card_visa\\") { id status amountCents } }","operationName":"Create","variables":{"amount":100,"currency":"EUR"}}'

local deliveries = {}

function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end

-- Each thread draws its own keys: wrk starts every thread's random
-- generator alike, so unseeded threads would send the same keys.
function init(args)
  local seed = 0
  for i = 1, #tag do seed = (seed * 31 + tag:byte(i)) % 2147483647 end
  math.randomseed(seed + tid * 7919)
  local path = os.getenv("IDEM_DELIVERIES")
  if path and mode:sub(1, 7) == "signed-" then
    for line in io.lines(path) do
      local id, sig = line:match("^([^\t]+)\t(.+)$")
      deliveries[#deliveries + 1] = { id, sig }
    end
  end
end

-- The signed body: what bench/ab signed for this id, byte for byte.
local function signed_body(id)
  return '{"id":"' .. id .. '","amount_cents":100,"currency":"EUR","payment_method_id":"pm_card_visa"}'
end

local function uuid()
  return string.format("%08x-%04x-4%03x-%04x-%04x%08x",
    math.random(0, 0xffffffff), math.random(0, 0xffff), math.random(0, 0xfff),
    math.random(0x8000, 0xbfff), math.random(0, 0xffff), math.random(0, 0xffffffff))
end

function request()
  local headers = { ["Content-Type"] = "application/json", ["Authorization"] = "Bearer bench" }
  if mode == "unique" then
    counter = counter + 1
    headers["Idempotency-Key"] = tag .. "-" .. tostring(tid) .. "-" .. counter
  elseif mode == "uuid" then
    headers["Idempotency-Key"] = tag .. "-" .. uuid()
  elseif mode == "replay" then
    headers["Idempotency-Key"] = "replay-" .. math.random(1, replay_keys)
  elseif mode == "rpc-unique" or mode == "rpc-replays" then
    -- A JSON-RPC call to /rpc, a new call id each time, its key in
    -- Idempotency-Key: fresh, or one of the warmed rpc-replay-N.
    -- A retry of a warmed call keeps the call's id, as a plain keyed
    -- client sends the same request again; the JSON-RPC route still
    -- gives the answer the id.
    counter = counter + 1
    local key, id
    if mode == "rpc-unique" then
      key, id = tag .. "-" .. tostring(tid) .. "-" .. counter, counter
    else
      id = math.random(1, replay_keys)
      key = "rpc-replay-" .. id
    end
    headers["Idempotency-Key"] = key
    local call = '{"jsonrpc":"2.0","id":' .. id .. ',"method":"payments.create","params":' .. body .. '}'
    return wrk.format("POST", "/rpc", headers, call)
  elseif mode == "gql-unique" or mode == "gql-replays" then
    -- A GraphQL mutation to /graphql, its key in Idempotency-Key: fresh,
    -- or one of the warmed gql-replay-N.
    if mode == "gql-unique" then
      counter = counter + 1
      headers["Idempotency-Key"] = tag .. "-" .. tostring(tid) .. "-" .. counter
    else
      headers["Idempotency-Key"] = "gql-replay-" .. math.random(1, replay_keys)
    end
    return wrk.format("POST", "/graphql", headers, mutation)
  elseif mode == "signed-unique" or mode == "signed-replays" then
    local d
    if mode == "signed-unique" then
      -- Threads take alternate lines, so that no two send one delivery.
      counter = counter + 1
      d = deliveries[((counter - 1) * 2 + tid - 1) % #deliveries + 1]
    else
      d = deliveries[math.random(1, #deliveries)]
    end
    headers["Idempotency-Key"] = d[1]
    headers["Stripe-Signature"] = d[2]
    return wrk.format("POST", "/v1/payments", headers, signed_body(d[1]))
  end
  return wrk.format("POST", "/v1/payments", headers, body)
end
