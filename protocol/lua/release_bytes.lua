-- RELEASE_BYTES (gateway, capacity.py): give back a batch's reservation, once per batch (HSETNX).
-- KEYS: 1 gateway batch record, 2 {ns}:gw:queued-bytes. ARGV: 1 owner, 2 now.
-- returns the bytes given back (0: none reserved, or given back already)
local b = tonumber(redis.call('HGET', KEYS[1], 'reserved_bytes') or '0')
if b <= 0 or redis.call('HSETNX', KEYS[1], 'bytes_released_at', ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[1], -b)
redis.call('HINCRBY', KEYS[2], '*', -b)
return b
