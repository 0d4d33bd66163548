-- SUBMIT_JOB (client)
-- KEYS: 1 record {ns}:job:{id}, 2 queue {ns}:q:{priority} (loose) or {ns}:q:{priority}:{batch_id} (a batch's),
--       3 registry {ns}:queues:{priority}
-- ARGV: 1 job_id, 2 request JSON, 3 now, 4 max_queue_len (0 = no limit; the depth counter, every queue), 5 result_ttl,
--       6 batch_id ('' = none), 7 custom_id ('' = none), 8 priority, 9 the namespace's layout (JSON, _layout.lua),
--       10 consumer group
-- returns {1, entry_id} queued | {0, status} already exists (idempotent) | {-1, depth} queue full
--       | {-2, its batch_id} a batch job (ARGV 6 set) whose id is taken by a job outside that batch
--       | an error reply: a priority not in the layout, or KEYS 2-3 not its queue and registry
-- Any existing key refuses the submit (EXISTS, not HGET status): a job is never reset or overwritten.
-- The request is written once, into the queue entry; the record gets it when the job ends (_keep_request.lua).
-- The record holds only short fields (a compact listpack hash), none that its key or its entry already holds:
-- no `id` (its key names it), no `request`, no `attempts` until a worker starts it (absent = 0).
-- A new queue gets the consumer group; a batch queue joins its priority's registry and, when it was not there
-- already, its ready set (intake reads from there; an entry in {ns}:wake wakes idle workers). The depth counter
-- counts the entry (_queue_depth.lua). SUBMIT_JOBS writes many jobs of one queue in one call (_submit.lua).
-- #include _submit.lua
local out = submit_jobs(cjson.decode(ARGV[9]), KEYS[2], KEYS[3], ARGV[8], ARGV[6], ARGV[3], tonumber(ARGV[4]),
                        ARGV[5], ARGV[10], 1, function() return KEYS[1], ARGV[1], ARGV[2], ARGV[7] end)
if out.err then return out end
return out[1]
