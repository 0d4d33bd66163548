-- ADMIT_JOB (gateway, kept_bytes.py): an interactive completion's most Redis bytes (its request, its result with
-- logprobs, its token stream, its ownership record) checked against its key's byte limit and the global one, and
-- kept in the ledgers until its records expire; its ownership record written; in one step, the call's one round
-- trip before its job is queued. `top_logprobs` 20 kept ~854 bytes a token for 7 days, counted nowhere (#34).
-- KEYS: 1 {ns}:gw:queued-bytes, 2 {ns}:gw:kept-bytes:{owner}, 3 {ns}:gw:kept-bytes:*, 4 {ns}:gw:job:{id},
--   5 {ns}:gw:config (max_queued_bytes_per_key, max_queued_bytes set there win over ARGV 3, 4)
-- ARGV: 1 owner, 2 bytes, 3 per-key limit, 4 global limit (0 = none), 5 now, 6 the end of the hour the bytes are
--   kept until, 7 the ownership record's ttl, 8.. its fields, name then value
-- returns {1, the owner's bytes after} written | {-1, owner's bytes} | {-2, all bytes}; nothing written unless 1
-- #include _reserve_bytes.lua
local set = redis.call('HMGET', KEYS[5], 'max_queued_bytes_per_key', 'max_queued_bytes')
local per_key = tonumber(set[1] or '') or tonumber(ARGV[3])
local total = tonumber(set[2] or '') or tonumber(ARGV[4])
local code, value = reserve_bytes(KEYS[1], ARGV[1], tonumber(ARGV[2]), per_key, total, KEYS[2], KEYS[3],
                                  tonumber(ARGV[5]), tonumber(ARGV[6]))
if code < 0 then return {code, value, per_key, total} end
local fields = {}
for i = 8, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[4], 'kept_bytes', ARGV[2], 'kept_until', ARGV[6], unpack(fields))
redis.call('EXPIRE', KEYS[4], ARGV[7])
return {1, value, per_key, total}
