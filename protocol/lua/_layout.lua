-- The key layout of one namespace, passed in as JSON by the caller (protocol/keys.py Keys.layout(), the one
-- definition of the keys and the priorities): no key name or priority is spelled in the Lua.
--   priorities  the priorities in the order workers serve them; default_priority: the default one
--   queue, registry, turn   priority -> its loose queue, its registry of batch queues, its round-robin turn
--   batch_queue             priority -> {prefix, suffix} of a batch's queue: prefix .. batch_id .. suffix
--   batch, batch_jobs       {prefix, suffix} of a batch record and of its job list
local function key(template, id) return template[1] .. id .. template[2] end
