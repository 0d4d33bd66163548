-- RETIRE_MODEL (the operator's `tokenbus models remove`)
-- Retire a declared model: its record and its names leave the registry (a job naming it is refused from then
-- on), and the namespace's default model is unset when it was this one (the next declared becomes it). A
-- model with jobs in its queues is kept unless forced: they would wait for a model nobody can name.
-- KEYS: 1 {ns}:models, 2 {ns}:model-names, 3 {ns}:config
-- ARGV: 1 the model's id, 2 the namespace's layout (JSON, _layout.lua), 3 '1' = even with jobs queued,
--       4 the config field naming the default model
-- returns {1, jobs in its queues} retired | {0, 0} not declared | {-1, jobs in its queues} kept (not forced)
-- #include _queue_depth.lua
-- #include _retire.lua
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return {0, 0} end
local depth = queue_depth(model_layout(cjson.decode(ARGV[2]), ARGV[1]))
if depth > 0 and ARGV[3] ~= '1' then return {-1, depth} end
retire(KEYS[1], KEYS[2], KEYS[3], ARGV[1], cjson.decode(raw), ARGV[4])
return {1, depth}
