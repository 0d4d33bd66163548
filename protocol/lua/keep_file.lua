-- KEEP_FILE (gateway, files/store.py): a file's metadata written and what it holds in Redis (its record by
-- MEMORY USAGE, its entries in the key's list and the expiring list) counted against its key as held until the
-- file is deleted (DROP_FILE), in one step. An upload is checked against the byte limits first; a file the
-- gateway makes (a batch's output) is counted without a check: its batch was admitted already. Writing a file
-- again (a retried finalisation) replaces its count.
-- KEYS: 1 {ns}:gw:file:{id}, 2 {ns}:gw:files:{owner}, 3 {ns}:gw:expiring-files, 4 {ns}:gw:queued-bytes,
--   5 {ns}:gw:kept-bytes:{owner}, 6 {ns}:gw:kept-bytes:*, 7 {ns}:gw:config (its limits win over ARGV 5, 6)
-- ARGV: 1 owner, 2 file id, 3 created_at, 4 expires_at ('' = never), 5 per-key limit, 6 global limit (0 = none),
--   7 now, 8 1 = check the limits, 0 = count only, 9 bytes of one entry in a list of ids, 10.. the fields
-- returns {1, bytes held} written | {-1, owner's bytes, per-key, global, bytes} | {-2, all bytes, ...}; nothing kept
--   unless 1
-- #include _reserve_bytes.lua
local old = tonumber(redis.call('HGET', KEYS[1], 'held_bytes') or '')
if old then
  unkeep_bytes(KEYS[5], old, HELD)
  unkeep_bytes(KEYS[6], old, HELD)
  redis.call('DEL', KEYS[1])
end
local fields = {}
for i = 10, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], 'held_bytes', 0, unpack(fields))  -- measured with the field it is written in
local entries = ARGV[4] == '' and 1 or 2
local b = (redis.call('MEMORY', 'USAGE', KEYS[1], 'SAMPLES', '0') or 0) + entries * tonumber(ARGV[9])
local now = tonumber(ARGV[7])
if ARGV[8] == '1' then
  local set = redis.call('HMGET', KEYS[7], 'max_queued_bytes_per_key', 'max_queued_bytes')
  local per_key = tonumber(set[1] or '') or tonumber(ARGV[5])
  local total = tonumber(set[2] or '') or tonumber(ARGV[6])
  local code, value = reserve_bytes(KEYS[4], ARGV[1], b, per_key, total, KEYS[5], KEYS[6], now, HELD)
  if code < 0 then
    redis.call('DEL', KEYS[1])
    return {code, value, per_key, total, b}
  end
else
  keep_bytes(KEYS[5], b, HELD, now)
  keep_bytes(KEYS[6], b, HELD, now)
end
redis.call('HSET', KEYS[1], 'held_bytes', b)
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
if ARGV[4] ~= '' then redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1] .. ':' .. ARGV[2]) end
return {1, b}
