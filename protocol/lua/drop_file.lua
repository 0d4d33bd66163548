-- DROP_FILE (gateway, files/store.py): a file's metadata deleted (DELETE, or its output_expires_after) and what
-- KEEP_FILE counted for it given back, in one step; a file gone already gives back nothing.
-- KEYS: 1 {ns}:gw:file:{id}, 2 {ns}:gw:files:{owner}, 3 {ns}:gw:expiring-files, 4 {ns}:gw:kept-bytes:{owner},
--   5 {ns}:gw:kept-bytes:*
-- ARGV: 1 file id, 2 its member in the expiring list (owner:id)
-- returns the bytes given back
-- #include _reserve_bytes.lua
local held = tonumber(redis.call('HGET', KEYS[1], 'held_bytes') or '') or 0
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[2])
unkeep_bytes(KEYS[4], held, HELD)
unkeep_bytes(KEYS[5], held, HELD)
return held
