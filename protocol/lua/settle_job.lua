-- SETTLE_JOB (gateway, kept_bytes.py): an interactive job has ended, so what its records hold is known: its
-- ledger entry (ADMIT_JOB's most bytes) becomes Redis's own count of them (MEMORY USAGE, every field), once.
-- KEYS: 1 {ns}:gw:job:{id}, 2 {ns}:gw:kept-bytes:{owner}, 3 {ns}:gw:kept-bytes:*, 4 {ns}:job:{id},
--   5 {ns}:job:{id}:tokens
-- returns the bytes given back (negative: its records hold more than the most estimated, counted as they are)
local f = redis.call('HMGET', KEYS[1], 'kept_bytes', 'kept_until', 'settled')
local held, till = tonumber(f[1] or ''), f[2]
if not held or not till or f[3] or redis.call('HEXISTS', KEYS[2], till) == 0 then return 0 end
local real = 0
for _, key in ipairs({KEYS[1], KEYS[4], KEYS[5]}) do
  real = real + (redis.call('MEMORY', 'USAGE', key, 'SAMPLES', '0') or 0)  -- false: no such key
end
redis.call('HINCRBY', KEYS[2], till, real - held)
redis.call('HINCRBY', KEYS[3], till, real - held)
redis.call('HSET', KEYS[1], 'kept_bytes', real, 'settled', 1)
return held - real
