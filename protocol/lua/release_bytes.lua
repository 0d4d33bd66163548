-- RELEASE_BYTES (gateway, capacity.py): give back a batch's reservation, once per batch (HSETNX); count what
-- its job records keep after it (its results) in the owner's ledger until they expire, and what its own record
-- holds (Redis's MEMORY USAGE of it, its errors included, and its entries in the key's list of batches and in
-- {ns}:gw:ended-batches) until the record goes: with a retention, in the ledger's hour the record expires in
-- (it is listed in {ns}:gw:ended-batches for FORGET_BATCH to delete at now + retention, and expires by itself at
-- the end of that hour whatever becomes of the sweep); without one (0), as held, for good (_reserve_bytes.lua).
-- KEYS: 1 gateway batch record, 2 {ns}:gw:queued-bytes, 3 {ns}:gw:kept-bytes:{owner}, 4 {ns}:gw:kept-bytes:*,
--   5 {ns}:gw:ended-batches
-- ARGV: 1 owner, 2 now, 3 bytes kept (0: none), 4 the end of the hour they are kept until, 5 bytes of one entry
--   in a list of ids, 6 the batch id, 7 the record's retention in seconds (0 = for good), 8 the end of the hour
--   now + retention falls in
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
local keep_s = tonumber(ARGV[7])
local held_until, entries = HELD, 1
if keep_s > 0 then held_until, entries = ARGV[8], 2 end
-- written before it is measured: the record holds the fields too
redis.call('HSET', KEYS[1], 'held_bytes', 0, 'held_until', held_until)
local held = (redis.call('MEMORY', 'USAGE', KEYS[1], 'SAMPLES', '0') or 0) + entries * tonumber(ARGV[5])
redis.call('HSET', KEYS[1], 'held_bytes', held)
keep_bytes(KEYS[3], held, held_until, now)
keep_bytes(KEYS[4], held, held_until, now)
if keep_s > 0 then
  redis.call('ZADD', KEYS[5], now + keep_s, ARGV[1] .. ':' .. ARGV[6])
  redis.call('EXPIREAT', KEYS[1], held_until)
end
return b
