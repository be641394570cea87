-- Mark-unknown-if-owner: the record stays processing, flagged
-- outcome_unknown. It keeps no TTL, so it is never removed automatically.
-- KEYS[1] record; ARGV[1] owner  [2] attempt
-- Returns 1, or 0 when fenced.
if not owned(KEYS[1], ARGV[1], ARGV[2], true) then
  return 0
end
redis.call('HSET', KEYS[1], 'ec', 'outcome_unknown', 'ua', int(now_ms()))
return 1
