-- START_BATCH (client)
-- KEYS: 1 batch record. ARGV: 1 now. validating -> in_progress (never undoes completed/cancelling).
if redis.call('HGET', KEYS[1], 'status') == 'validating' then
  redis.call('HSET', KEYS[1], 'status', 'in_progress', 'in_progress_at', ARGV[1])
  return 1
end
return 0
