-- SUBMIT_JOBS (client): SUBMIT_JOB for n jobs of one queue in one call (a batch's ingest: docs/bench_million.md)
-- KEYS: 1 .. n the records {ns}:job:{id}, one per job
-- ARGV: 1 now, 2 max_queue_len (0 = no limit), 3 result_ttl, 4 batch_id ('' = none), 5 priority, 6 the layout
--       (JSON, _layout.lua), 7 consumer group, 8 model ('' = none: the default queues), then three per job, in
--       the order of its record in KEYS: job_id, request JSON, custom_id ('' = none)
-- returns a list of n replies, the i-th what SUBMIT_JOB returns for job i ({1, entry_id} | {0, status} |
--       {-1, depth} | {-2, batch_id}); n times {-3, declared model ids} when the model is not declared; or an
--       error reply (as SUBMIT_JOB's), with nothing written.
-- Each job is written as SUBMIT_JOB writes it; a job refused (it exists, the queue is full) leaves the others
-- be. One call holds Redis for its n jobs: callers send a few hundred at a time.
-- #include _submit.lua
local n = #KEYS
if #ARGV ~= 8 + 3 * n then
  return redis.error_reply('ERR submit: ' .. n .. ' records need ' .. (8 + 3 * n) .. ' ARGV, got ' .. #ARGV)
end
local L = cjson.decode(ARGV[6])
local M = route(L, ARGV[8])
if not M then
  local refused, out = not_declared(L), {}
  for i = 1, n do out[i] = refused end
  return out
end
return submit_jobs(L, M, ARGV[5], ARGV[4], ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[7], n,
                   function(i) return KEYS[i], ARGV[6 + 3 * i], ARGV[7 + 3 * i], ARGV[8 + 3 * i] end)
