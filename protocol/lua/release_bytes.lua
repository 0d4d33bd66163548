-- RELEASE_BYTES (gateway, capacity.py): give back a batch's reservation, once per batch (HSETNX); count what
-- its job records keep after it (its results) in the owner's ledger until they expire, and what its own record
-- holds (Redis's MEMORY USAGE of it, its errors included, and its entry in the key's list) as held for as long
-- as the record is kept: the record outlives its results (_reserve_bytes.lua).
-- KEYS: 1 gateway batch record, 2 {ns}:gw:queued-bytes, 3 {ns}:gw:kept-bytes:{owner}, 4 {ns}:gw:kept-bytes:*
-- ARGV: 1 owner, 2 now, 3 bytes kept (0: none), 4 the end of the hour they are kept until, 5 bytes of the
--   record's entry in the key's list of batches
-- returns the bytes given back (0: none reserved, or given back already)
-- #include _reserve_bytes.lua
local b = tonumber(redis.call('HGET', KEYS[1], 'reserved_bytes') or '0')
if b <= 0 or redis.call('HSETNX', KEYS[1], 'bytes_released_at', ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[1], -b)
redis.call('HINCRBY', KEYS[2], '*', -b)
local kept, till, now = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[2])
if kept > 0 and till > now then
  keep_bytes(KEYS[3], kept, till, now)
  keep_bytes(KEYS[4], kept, till, now)
  redis.call('HSET', KEYS[1], 'kept_bytes', kept, 'kept_until', till)
end
redis.call('HSET', KEYS[1], 'held_bytes', 0)  -- written before it is measured: the record holds the field too
local held = (redis.call('MEMORY', 'USAGE', KEYS[1], 'SAMPLES', '0') or 0) + tonumber(ARGV[5])
redis.call('HSET', KEYS[1], 'held_bytes', held)
keep_bytes(KEYS[3], held, HELD, now)
keep_bytes(KEYS[4], held, HELD, now)
return b
