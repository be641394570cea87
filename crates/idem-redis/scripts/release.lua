-- Release-if-owner: delete a processing record so its key is free again.
-- KEYS[1] record; ARGV[1] owner  [2] attempt
-- Returns 1, or 0 when fenced.
if not owned(KEYS[1], ARGV[1], ARGV[2], true) then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
