-- SUBMIT_JOB (client)
-- KEYS: 1 record {ns}:job:{id} (the queue is found from the layout and the model; older callers' KEYS 2-3, the
--       default queue and its registry, are ignored)
-- ARGV: 1 job_id, 2 request JSON, 3 now, 4 max_queue_len (0 = no limit; the depth counter, every queue of the
--       job's model), 5 result_ttl, 6 batch_id ('' = none), 7 custom_id ('' = none), 8 priority, 9 the namespace's
--       layout (JSON, _layout.lua), 10 consumer group, 11 model (the request's `model`; '' or absent = none)
-- returns {1, entry_id} queued | {0, status} already exists (idempotent) | {-1, depth} queue full
--       | {-2, its batch_id} a batch job (ARGV 6 set) whose id is taken by a job outside that batch
--       | {-3, JSON list of the declared model ids} the model is not declared (nothing written)
--       | an error reply: a priority not in the layout
-- The queue: {ns}:m:{model id}:q:{priority}[:{batch_id}] for a declared model name (any of its names, looked
-- up in {ns}:model-names), {ns}:q:{priority}[:{batch_id}] (the default queues) for a job naming none, and for
-- every job while no model is declared at all.
-- Any existing key refuses the submit (EXISTS, not HGET status): a job is never reset or overwritten.
-- The request is written once, into the queue entry; the record gets it when the job ends (_keep_request.lua).
-- The record holds only short fields (a compact listpack hash), none that its key or its entry already holds:
-- no `id` (its key names it), no `request`, no `attempts` until a worker starts it (absent = 0).
-- A new queue gets the consumer group; a batch queue joins its priority's registry and, when it was not there
-- already, its ready set (intake reads from there; an entry in the model's wake stream wakes idle workers), and
-- the batch record's `queues`. The depth counter counts the entry (_queue_depth.lua). SUBMIT_JOBS writes many
-- jobs of one queue in one call (_submit.lua).
-- #include _submit.lua
local L = cjson.decode(ARGV[9])
local M = route(L, ARGV[11])
if not M then return not_declared(L) end
local out = submit_jobs(L, M, ARGV[8], ARGV[6], ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[10], 1,
                        function() return KEYS[1], ARGV[1], ARGV[2], ARGV[7] end)
if out.err then return out end
return out[1]
