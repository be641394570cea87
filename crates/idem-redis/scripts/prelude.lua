-- Shared by every idem script (prepended at build time).
--
-- A record is one hash at KEYS[1] with the fields:
--   tn op ky  tenant, operation, key (as given)
--   fp        fingerprint (32 raw bytes)
--   st        state: processing | completed | failed
--   ca ua ea  created, updated, expires (ms since the epoch, Redis clock)
--   lu ow at  lease: locked until (ms), owner (16 raw bytes), attempt
--   rs rh rb  response status, encoded headers, body (final records)
--   ri ec     resource id, error code (optional)
-- Processing records carry no TTL (they never vanish on their own); final
-- records expire at ea through PEXPIREAT. Copies put by a fast tier expire
-- at ea (final) or lu (processing).

-- Milliseconds since the epoch on the Redis server's clock.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- An integer as decimal text (never in exponent notation).
local function int(x)
  return string.format('%d', x)
end

-- Whether the record exists and belongs to owner + attempt (and, if asked,
-- is still processing).
local function owned(key, owner, attempt, processing_only)
  local r = redis.call('HMGET', key, 'ow', 'at', 'st')
  if not r[1] or r[1] ~= owner or r[2] ~= attempt then
    return false
  end
  if processing_only and r[3] ~= 'processing' then
    return false
  end
  return true
end
