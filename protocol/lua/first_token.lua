-- FIRST_TOKEN (worker)
-- KEYS: 1 record; ARGV: 1 now. Sets first_token_at only while running (never recreates an expired record).
if redis.call('HGET', KEYS[1], 'status') == 'running' then
  redis.call('HSET', KEYS[1], 'first_token_at', ARGV[1])
  return 1
end
return 0
