-- UI_LOGOUT (gateway, ui/session.py): a dashboard session ended before its time and what UI_LOGIN counted for it
-- given back, in one step; a session gone already gives back nothing.
-- KEYS: 1 {ns}:gw:ui:session:{hash}, 2 {ns}:gw:ui:sessions:{owner}, 3 {ns}:gw:kept-bytes:{owner},
--   4 {ns}:gw:kept-bytes:*
-- ARGV: 1 the token's hash
-- returns the bytes given back
-- #include _reserve_bytes.lua
local f = redis.call('HMGET', KEYS[1], 'kept_bytes', 'kept_until')
local b = tonumber(f[1] or '') or 0
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if f[2] then
  unkeep_bytes(KEYS[3], b, f[2])
  unkeep_bytes(KEYS[4], b, f[2])
end
return b
