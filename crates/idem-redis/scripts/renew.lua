-- Renew-if-owner: extend a processing record's lease to now + duration.
-- A copy put by a fast tier (it has a TTL) keeps living as long as its lease.
-- KEYS[1] record; ARGV[1] owner  [2] attempt  [3] duration ms
-- Returns the new locked_until, or -1 when fenced.
local key = KEYS[1]
if not owned(key, ARGV[1], ARGV[2], true) then
  return -1
end
local now = now_ms()
local locked_until = now + tonumber(ARGV[3])
redis.call('HSET', key, 'lu', int(locked_until), 'ua', int(now))
if redis.call('PTTL', key) > 0 then
  redis.call('PEXPIREAT', key, int(locked_until))
end
return locked_until
