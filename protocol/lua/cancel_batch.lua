-- CANCEL_BATCH (client)
-- KEYS: 1 batch record. ARGV: 1 now. validating|in_progress -> cancelling; returns the status after.
local s = redis.call('HGET', KEYS[1], 'status')
if not s then return '' end
if s == 'validating' or s == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelled_at', ARGV[1])
  return 'cancelling'
end
return s
