-- ADAPTER_REMOVE (the operator's `tokenbus adapters remove`)
-- Ask every worker serving a LoRA adapter to stop and unload it, and retire its model (its names leave the
-- registry: a job naming it is refused with model_not_found from then on). Its entry in {ns}:adapters becomes
-- {name, base, state "removed", rev, at}, which wins over a worker's --lora flag (at its next start too), and
-- ':rev' goes one higher. Kept while its queues hold jobs, unless forced. Repeating it writes nothing.
-- KEYS: 1 {ns}:adapters, 2 {ns}:models, 3 {ns}:model-names, 4 {ns}:config
-- ARGV: 1 the adapter (any of its names), 2 the namespace's layout (JSON), 3 '1' = even with jobs queued,
--       4 the config field naming the default model, 5 now (epoch seconds)
-- returns {1, rev, base id, jobs} removed | {0, rev, base id} no adapter of that name (already removed) |
--         {-1, jobs in its queues} kept (not forced) | {-2, id} a base model, not an adapter
-- #include _queue_depth.lua
-- #include _retire.lua
local id = redis.call('HGET', KEYS[3], ARGV[1]) or ARGV[1]
local raw = redis.call('HGET', KEYS[2], id)
local rec = raw and cjson.decode(raw)
if rec and (not rec.parent or rec.parent == cjson.null) then return {-2, id} end
local cur = redis.call('HGET', KEYS[1], id)
local entry = cur and cjson.decode(cur)
local rev = tonumber(redis.call('HGET', KEYS[1], ':rev') or '0')
if not rec and (not entry or entry.state == 'removed') then return {0, rev, (entry and entry.base) or ''} end
local base = (rec and rec.parent) or entry.base
local depth = 0
if rec then
  depth = queue_depth(model_layout(cjson.decode(ARGV[2]), id))
  if depth > 0 and ARGV[3] ~= '1' then return {-1, depth} end
  retire(KEYS[2], KEYS[3], KEYS[4], id, rec, ARGV[4])
end
rev = redis.call('HINCRBY', KEYS[1], ':rev', 1)
redis.call('HSET', KEYS[1], id,
  cjson.encode({name = id, base = base, state = 'removed', rev = rev, at = tonumber(ARGV[5])}))
return {1, rev, base, depth}
