-- UI_LOGOUT (gateway, ui/session.py): a dashboard session ended before its time and what UI_LOGIN counted for it
-- given back, in one step; a session gone already gives back nothing.
-- KEYS: 1 {ns}:gw:ui:session:{hash}, 2 {ns}:gw:ui:sessions:{owner}, 3 {ns}:gw:kept-bytes:{owner},
--   4 {ns}:gw:kept-bytes:*
-- ARGV: 1 the token's hash
-- returns the bytes given back
-- #include _reserve_bytes.lua
local b = drop_counted(KEYS[1], 'kept_bytes', 'kept_until', KEYS[3], KEYS[4])
redis.call('ZREM', KEYS[2], ARGV[1])
return b
