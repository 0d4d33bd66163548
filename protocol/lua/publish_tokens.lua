-- PUBLISH_TOKENS (worker)
-- One chunk of a streaming job's output. The token stream expires with the job record: EXPIRE
-- by the record's result_ttl (0 = kept, like the record), the worker's own result_ttl_s only for a record
-- written without one. Nothing is written once the record is gone (expired, or deleted).
-- KEYS: 1 token stream {ns}:job:{id}:tokens, 2 record {ns}:job:{id}
-- ARGV: 1 offset, 2 token ids (JSON list), 3 text, 4 done (1 on the last chunk, else 0),
--       5 default ttl (seconds, for a record without result_ttl)
-- returns the chunk's entry id | false: no record, nothing written
if redis.call('EXISTS', KEYS[2]) == 0 then return false end
local id = redis.call('XADD', KEYS[1], '*', 'offset', ARGV[1], 'token_ids', ARGV[2], 'text', ARGV[3],
                      'done', ARGV[4])
local ttl = tonumber(redis.call('HGET', KEYS[2], 'result_ttl') or ARGV[5])
if ttl and ttl > 0 then redis.call('EXPIRE', KEYS[1], ttl) end
return id
