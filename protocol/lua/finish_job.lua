-- FINISH_JOB (worker)
-- KEYS: 1 record, 2 the entry's queue (with ARGV 2 ''; the record's queue, else this), 3 stream {ns}:events,
--       4 set {ns}:cancel, 5 the job's token stream {ns}:job:{id}:tokens (a streamed job's final done chunk,
--       _end_stream.lua; optional: without it none is added), 6 an embedding job's {ns}:job:{id}:vectors
--       (optional, with ARGV 12)
-- ARGV: 1 group, 2 entry_id ('' = the record's entry_id, in the record's queue), 3 job_id,
--       4 status (finished|failed|cancelled), 5 result JSON ('' = none), 6 error message ('' = none),
--       7 error_code ('' = none), 8 now,
--       9 default result_ttl (used when the record has none), 10 the namespace's layout (JSON, _layout.lua),
--       11 events maxlen, 12 an embedding job's vectors (raw bytes; '' or absent = none),
--       13 (optional) the result's usage '[input, cached, output]' (JSON; '' = none): added to the batch's
--       input_tokens, cached_tokens, output_tokens
-- returns 1 ended now | 0 was already terminal (not overwritten) | -1 no record; the entry is always
--         acked + deleted (the depth counter counts both) and the id removed from the cancel set
-- A job whose request asked for a stream gets its final done chunk now if its worker wrote none.
-- #include _is_terminal.lua
-- #include _bump_batch.lua
-- #include _queue_depth.lua
-- #include _keep_request.lua
-- #include _end_stream.lua
local st = ARGV[4]
if not is_terminal(st) then
  return redis.error_reply('ERR finish: status must be finished, failed or cancelled, got ' .. st)
end
local L = cjson.decode(ARGV[10])
local cur = redis.call('HMGET', KEYS[1], 'status', 'entry_id', 'result_ttl', 'batch_id', 'queue')
local entry, stream = ARGV[2], KEYS[2]
if entry == '' and cur[2] then entry, stream = cur[2], cur[5] or KEYS[2] end
local M = layout_of_queue(L, stream)  -- the depth counter of the entry's model
depth_init(M)
redis.call('SREM', KEYS[4], ARGV[3])
local function ack()
  if entry ~= '' then ack_del(M, stream, ARGV[1], entry) end
end
if not cur[1] then ack() return -1 end
if is_terminal(cur[1]) then ack() return 0 end
redis.call('HSET', KEYS[1], 'status', st, 'finished_at', ARGV[8])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[5]) end
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[6]) end
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'error_code', ARGV[7]) end
local ttl = tonumber(cur[3] or ARGV[9])
if ttl and ttl > 0 then redis.call('EXPIRE', KEYS[1], ttl) end
if KEYS[6] and ARGV[12] and ARGV[12] ~= '' then
  redis.call('SET', KEYS[6], ARGV[12])
  if ttl and ttl > 0 then redis.call('EXPIRE', KEYS[6], ttl) end
end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[11], '*', 'job_id', ARGV[3], 'status', st)
keep_request(KEYS[1], stream, entry)  -- before the entry goes
end_stream(KEYS[5], redis.call('HGET', KEYS[1], 'request'), ttl)
ack()  -- before bump_batch: the batch's last entry gone, its ended queue can be deleted
if cur[4] and cur[4] ~= '' and ARGV[13] and ARGV[13] ~= '' then
  local bkey = key(L.batch, cur[4])
  if redis.call('EXISTS', bkey) == 1 then  -- before bump_batch: the sums are exact when the batch ends
    local u = cjson.decode(ARGV[13])
    redis.call('HINCRBY', bkey, 'input_tokens', u[1])
    redis.call('HINCRBY', bkey, 'cached_tokens', u[2])
    redis.call('HINCRBY', bkey, 'output_tokens', u[3])
  end
end
bump_batch(L, cur[4], st, ARGV[8], ttl)
return 1
