-- Resolve-if-owner: record the final answer. Fenced by owner and attempt
-- only (the same owner resolving again succeeds). The record then expires
-- at its new retention.
-- KEYS[1] record
-- ARGV[1] owner  [2] attempt  [3] state  [4] retention ms  [5] status
--     [6] encoded headers  [7] body  [8] resource id  [9] error code
--     ([8] and [9] are '1' .. value, or '0' for none)
-- Returns 1, or 0 when fenced.
local key = KEYS[1]
local r = redis.call('HMGET', key, 'ow', 'at', 'ri', 'ec')
if not r[1] or r[1] ~= ARGV[1] or r[2] ~= ARGV[2] then
  return 0
end
local now = now_ms()
local expires_at = now + tonumber(ARGV[4])
local set = {'st', ARGV[3], 'ua', int(now), 'ea', int(expires_at),
  'rs', ARGV[5], 'rh', ARGV[6], 'rb', ARGV[7]}
local gone = {}
-- Optional fields: '1' .. value sets one; '0' removes it if it is there.
for i, field in ipairs({'ri', 'ec'}) do
  local flagged = ARGV[7 + i]
  if string.sub(flagged, 1, 1) == '1' then
    set[#set + 1] = field
    set[#set + 1] = string.sub(flagged, 2)
  elseif r[2 + i] then
    gone[#gone + 1] = field
  end
end
redis.call('HSET', key, unpack(set))
if #gone > 0 then
  redis.call('HDEL', key, unpack(gone))
end
redis.call('PEXPIREAT', key, int(expires_at))
return 1
