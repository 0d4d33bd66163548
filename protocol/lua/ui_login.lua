-- UI_LOGIN (gateway, ui/session.py): a new dashboard session written, counted against its key in the ledger until
-- it expires (its record by MEMORY USAGE, its entry in the key's index), and the key's sessions beyond its cap
-- ended (the oldest, their bytes given back), in one step: checked against the byte limits with what the
-- ended sessions free, so a key at its cap can always log in again. Past a limit, nothing changes.
-- KEYS: 1 {ns}:gw:ui:session:{hash}, 2 {ns}:gw:ui:sessions:{owner}, 3 {ns}:gw:queued-bytes,
--   4 {ns}:gw:kept-bytes:{owner}, 5 {ns}:gw:kept-bytes:*, 6 {ns}:gw:config (its limits win over ARGV 7, 8)
-- ARGV: 1 owner, 2 the token's hash, 3 now, 4 ttl (s), 5 the key's cap of sessions, 6 the end of the hour the
--   session has expired by, 7 per-key limit, 8 global limit (0 = none), 9 the key prefix of a session record,
--   10 bytes of one entry in a sorted set of ids, 11.. the session's fields
-- returns {1, bytes counted, sessions ended} | {-1, owner's bytes, per-key, global, bytes} | {-2, all bytes, ...}
-- #include _reserve_bytes.lua
local now, ttl, till = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl)  -- expired by their own TTL already
local ending, freed = {}, 0
for _, hash in ipairs(redis.call('ZRANGE', KEYS[2], 0, -tonumber(ARGV[5]))) do  -- the oldest past cap - 1
  local f = redis.call('HMGET', ARGV[9] .. hash, 'kept_bytes', 'kept_until')
  local b = tonumber(f[1] or '') or 0
  if f[2] and redis.call('HEXISTS', KEYS[4], f[2]) == 1 then freed = freed + b end
  ending[#ending + 1] = {hash, b, f[2]}
end
local fields = {}
for i = 11, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], 'kept_bytes', 0, 'kept_until', till, unpack(fields))
local b = (redis.call('MEMORY', 'USAGE', KEYS[1], 'SAMPLES', '0') or 0) + tonumber(ARGV[10])
local set = redis.call('HMGET', KEYS[6], 'max_queued_bytes_per_key', 'max_queued_bytes')
local per_key = tonumber(set[1] or '') or tonumber(ARGV[7])
local total = tonumber(set[2] or '') or tonumber(ARGV[8])
local code, value = reserve_bytes(KEYS[3], ARGV[1], b, per_key, total, KEYS[4], KEYS[5], now, till, freed)
if code < 0 then
  redis.call('DEL', KEYS[1])
  return {code, value, per_key, total, b}
end
for _, s in ipairs(ending) do
  redis.call('DEL', ARGV[9] .. s[1])
  redis.call('ZREM', KEYS[2], s[1])
  if s[3] then
    unkeep_bytes(KEYS[4], s[2], s[3])
    unkeep_bytes(KEYS[5], s[2], s[3])
  end
end
redis.call('HSET', KEYS[1], 'kept_bytes', b)
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('ZADD', KEYS[2], now, ARGV[2])
redis.call('EXPIRE', KEYS[2], ttl)
return {1, b, #ending}
