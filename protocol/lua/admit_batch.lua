-- ADMIT_BATCH (gateway, capacity.py): a new batch checked against its key's quotas on queued work and the byte
-- limits, and written, in one step: checked and written in two, 24 simultaneous creates against a limit of 10
-- queued requests let 18 through (issue #34).
-- KEYS: 1 {ns}:gw:queued-bytes, 2 the new gateway batch record, 3 {ns}:gw:batches:{owner}, 4 {ns}:gw:validating,
--   5 {ns}:gw:kept-bytes:{owner}, 6 {ns}:gw:kept-bytes:* (the results kept of its calls and ended batches count too),
--   7 the record of the ended batch it retries (any key when it retries none)
-- ARGV: 1 owner, 2 bytes to reserve, 3 per-key byte limit, 4 global byte limit (0 = none), 5 the batch's
--   requests, 6 its tokens, 7 max queued requests per key, 8 max queued tokens per key, 9 the key prefix of a
--   gateway batch record, 10 of a producer batch record, 11 the newest batches looked at, 12 now, 13 the batch id,
--   14 the batch statuses that have ended (comma-separated), 15 the id of the batch it retries ('' = none; that
--   record, unless it has gone past its retention, is linked to it: retried_by), 16.. the record's fields, name
--   then value
-- What a key has queued: over its newest ARGV[11] batches not ended, each batch's total less what ended, and its
-- token estimate in proportion.
-- returns {1, the owner's bytes after} written | {-1, owner's bytes} | {-2, all bytes} (the byte limits) |
--   {-3, requests queued} | {-4, tokens queued} (the key's quotas); nothing is written unless 1
-- #include _reserve_bytes.lua
local ended = {}
for s in string.gmatch(ARGV[14], '[^,]+') do ended[s] = true end
local requests, tokens = 0, 0
for _, bid in ipairs(redis.call('ZREVRANGE', KEYS[3], 0, tonumber(ARGV[11]) - 1)) do
  local gw = redis.call('HMGET', ARGV[9] .. bid, 'final_status', 'total', 'tokens')
  local core = redis.call('HMGET', ARGV[10] .. bid, 'status', 'finished', 'failed', 'cancelled')
  local total = tonumber(gw[2] or '') or 0
  if (not gw[1] or gw[1] == '') and total > 0 and not ended[core[1] or ''] then
    local left = math.max(0, total - (tonumber(core[2] or '') or 0) - (tonumber(core[3] or '') or 0)
                             - (tonumber(core[4] or '') or 0))
    requests = requests + left
    tokens = tokens + math.floor((tonumber(gw[3] or '') or 0) * left / total)
  end
end
if requests + tonumber(ARGV[5]) > tonumber(ARGV[7]) then return {-3, requests} end
if tokens + tonumber(ARGV[6]) > tonumber(ARGV[8]) then return {-4, tokens} end
local code, value = reserve_bytes(KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]),
                                  KEYS[5], KEYS[6], tonumber(ARGV[12]), 0)
if code < 0 then return {code, value} end
local fields = {}
for i = 16, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('ZADD', KEYS[3], ARGV[12], ARGV[13])
redis.call('SADD', KEYS[4], ARGV[13])
if ARGV[15] ~= '' and redis.call('EXISTS', KEYS[7]) == 1 then  -- written to a deleted record, it would stay
  redis.call('HSET', KEYS[7], 'retried_by', ARGV[13])
end
return {1, value}
