-- RESERVE_BYTES (gateway, capacity.py): reserve a batch's Redis bytes for its owner before any job is written.
-- KEYS: 1 {ns}:gw:queued-bytes. ARGV: 1 owner, 2 bytes, 3 per-key limit, 4 global limit (0 = none)
-- returns {1, the owner's bytes after} reserved | {-1, the owner's bytes} per-key limit | {-2, all bytes} global limit
local mine = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local all = tonumber(redis.call('HGET', KEYS[1], '*') or '0')
local b = tonumber(ARGV[2])
if tonumber(ARGV[3]) > 0 and mine + b > tonumber(ARGV[3]) then return {-1, mine} end
if tonumber(ARGV[4]) > 0 and all + b > tonumber(ARGV[4]) then return {-2, all} end
redis.call('HINCRBY', KEYS[1], ARGV[1], b)
redis.call('HINCRBY', KEYS[1], '*', b)
return {1, mine + b}
