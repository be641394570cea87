-- Resolve-if-owner: record the final answer. Fenced by owner and attempt
-- only (the same owner resolving again succeeds). The record then expires
-- at its new retention.
-- KEYS[1] record
-- ARGV[1] owner  [2] attempt  [3] state  [4] retention ms  [5] status
--     [6] encoded headers  [7] body  [8] resource id  [9] error code
--     ([8] and [9] are '1' .. value, or '0' for none)
-- Returns 1, or 0 when fenced.
local key = KEYS[1]
if not owned(key, ARGV[1], ARGV[2], false) then
  return 0
end
local now = now_ms()
local expires_at = now + tonumber(ARGV[4])
redis.call('HSET', key, 'st', ARGV[3], 'ua', int(now), 'ea', int(expires_at),
  'rs', ARGV[5], 'rh', ARGV[6], 'rb', ARGV[7])
optional(key, 'ri', ARGV[8])
optional(key, 'ec', ARGV[9])
redis.call('PEXPIREAT', key, int(expires_at))
return 1
