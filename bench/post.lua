-- POST a small JSON payment; with IDEM_KEYS=unique a fresh Idempotency-Key
-- per request, with IDEM_KEYS=replay one of IDEM_REPLAY_KEYS warmed keys,
-- otherwise no key (pass-through).
local mode = os.getenv("IDEM_KEYS") or "none"
local tag = os.getenv("IDEM_RUN_TAG") or tostring(os.time())
local replay_keys = tonumber(os.getenv("IDEM_REPLAY_KEYS") or "100")
local threads = 0
local counter = 0
local body = '{"amount_cents":100,"currency":"EUR","payment_method_id":"pm_card_visa"}'

function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end

function request()
  local headers = { ["Content-Type"] = "application/json", ["Authorization"] = "Bearer bench" }
  if mode == "unique" then
    counter = counter + 1
    headers["Idempotency-Key"] = tag .. "-" .. tostring(tid) .. "-" .. counter
  elseif mode == "replay" then
    headers["Idempotency-Key"] = "replay-" .. math.random(1, replay_keys)
  end
  return wrk.format("POST", "/v1/payments", headers, body)
end
