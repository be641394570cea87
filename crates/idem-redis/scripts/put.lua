-- Put a copy of a record made elsewhere (the fast tier of idem::Tiered),
-- replacing any copy; it expires at ARGV[1] (ms since the epoch): its
-- expiry when final, its lease's end when processing. Nothing is kept if
-- that time has passed.
-- KEYS[1] record; ARGV[1] expire at ms; ARGV[2..] field, value, ...
-- Returns 1 if kept, 0 if already stale.
local key = KEYS[1]
redis.call('DEL', key)
if tonumber(ARGV[1]) <= now_ms() then
  return 0
end
redis.call('HSET', key, unpack(ARGV, 2))
redis.call('PEXPIREAT', key, ARGV[1])
return 1
