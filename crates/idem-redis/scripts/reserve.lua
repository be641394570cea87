-- Reserve-or-report, atomically; mirrors idem::store::decide_existing.
-- KEYS[1] record
-- ARGV[1] tenant  [2] operation  [3] key  [4] fingerprint  [5] owner
--     [6] lease ms  [7] retention ms  [8] 'retry' | 'hold'
-- Returns one of
--   {'acquired', attempt, locked_until}
--   {'existing', {field, value, ...}}       a final record to replay
--   {'in_progress', retry_after_ms, unknown (0/1)}
--   {'mismatch', state}
local key = KEYS[1]
local now = now_ms()
local lease = tonumber(ARGV[6])

-- replace: a hash is there (an expired record) and goes first.
local function create(replace)
  local locked_until = now + lease
  if replace then
    redis.call('DEL', key)
  end
  redis.call('HSET', key,
    'tn', ARGV[1], 'op', ARGV[2], 'ky', ARGV[3], 'fp', ARGV[4],
    'st', 'processing', 'ca', int(now), 'ua', int(now),
    'ea', int(now + tonumber(ARGV[7])), 'lu', int(locked_until),
    'ow', ARGV[5], 'at', '1')
  return {'acquired', 1, locked_until}
end

local r = redis.call('HMGET', key, 'st', 'fp', 'ea', 'lu', 'at', 'ec')
local state = r[1]
if not state then
  -- No record; a hash with fields but no state was not written by idem
  -- and goes.
  return create(r[2] or r[3] or r[4] or r[5] or r[6])
end
-- A final record past its retention is logically gone: replace it.
if state ~= 'processing' and tonumber(r[3]) <= now then
  return create(true)
end
if r[2] ~= ARGV[4] then
  return {'mismatch', state}
end
if state ~= 'processing' then
  return {'existing', redis.call('HGETALL', key)}
end
local unknown = 0
if r[6] == 'outcome_unknown' then
  unknown = 1
end
local locked_until = tonumber(r[4])
if locked_until > now then
  return {'in_progress', locked_until - now, unknown}
end
if ARGV[8] == 'retry' then
  local attempt = tonumber(r[5]) + 1
  locked_until = now + lease
  redis.call('HSET', key, 'ow', ARGV[5], 'at', int(attempt),
    'lu', int(locked_until), 'ua', int(now))
  return {'acquired', attempt, locked_until}
end
-- Held: its owner stopped renewing, so whatever it did is unknown.
return {'in_progress', lease, 1}
