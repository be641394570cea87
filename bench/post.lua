-- POST a small JSON payment; with IDEM_KEYS=unique a fresh Idempotency-Key
-- per request, in order (`<tag>-<thread>-<n>`); with IDEM_KEYS=uuid a fresh
-- one in no order, shaped as a version-4 UUID, as most clients make them;
-- with IDEM_KEYS=replay one of IDEM_REPLAY_KEYS warmed keys; otherwise no
-- key (pass-through).
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

-- Each thread draws its own keys: wrk starts every thread's random
-- generator alike, so unseeded threads would send the same keys.
function init(args)
  local seed = 0
  for i = 1, #tag do seed = (seed * 31 + tag:byte(i)) % 2147483647 end
  math.randomseed(seed + tid * 7919)
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
  end
  return wrk.format("POST", "/v1/payments", headers, body)
end
