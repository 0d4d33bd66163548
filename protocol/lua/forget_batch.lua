-- FORGET_BATCH (gateway, batches/retention.py): an ended batch whose retention has passed deleted, in one step:
-- its record, its entries in the key's list of batches and in {ns}:gw:ended-batches, and what RELEASE_BYTES
-- counted for the record given back to the ledgers. A record gone already (it expired by itself at the end of
-- the hour it was counted in, or was forgotten before) gives back nothing; its entries still go.
-- KEYS: 1 {ns}:gw:batch:{id}, 2 {ns}:gw:batches:{owner}, 3 {ns}:gw:ended-batches, 4 {ns}:gw:kept-bytes:{owner},
--   5 {ns}:gw:kept-bytes:*
-- ARGV: 1 the batch id, 2 its member in {ns}:gw:ended-batches (owner:id)
-- returns the bytes given back
-- #include _reserve_bytes.lua
local b = drop_counted(KEYS[1], 'held_bytes', 'held_until', KEYS[4], KEYS[5])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[2])
return b
