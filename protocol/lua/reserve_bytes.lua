-- RESERVE_BYTES (gateway, capacity.py): reserve Redis bytes for an owner, alone (ADMIT_BATCH does it for a batch).
-- KEYS: 1 {ns}:gw:queued-bytes, 2 {ns}:gw:kept-bytes:{owner}, 3 {ns}:gw:kept-bytes:*
-- ARGV: 1 owner, 2 bytes, 3 per-key limit, 4 global limit (0 = none), 5 now
-- returns {1, the owner's bytes after} reserved | {-1, the owner's bytes} per-key limit | {-2, all bytes} global limit
-- #include _reserve_bytes.lua
local code, value = reserve_bytes(KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]),
                                  KEYS[2], KEYS[3], tonumber(ARGV[5]), 0)
return {code, value}
