-- Read a record; a final record past its retention reads as absent even
-- in the instant before Redis expires it.
-- KEYS[1] record
-- Returns {field, value, ...}, or nil.
local key = KEYS[1]
local r = redis.call('HMGET', key, 'st', 'ea')
if not r[1] then
  return false
end
if r[1] ~= 'processing' and tonumber(r[2]) <= now_ms() then
  return false
end
return redis.call('HGETALL', key)
