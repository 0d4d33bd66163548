-- The key layout of one namespace, passed in as JSON by the caller (protocol/keys.py Keys.layout(), the one
-- definition of the keys and the priorities): no key name or priority is spelled in the Lua.
--   priorities  the priorities in the order workers serve them; default_priority: the default one
--   queue, registry, turn   priority -> its loose queue, its registry of batch queues, its round-robin turn
--   batch_queue             priority -> {prefix, suffix} of a batch's queue: prefix .. batch_id .. suffix
--   batch, batch_jobs       {prefix, suffix} of a batch record and of its job list
--   prefix, model_prefix    the namespace's `{ns}`, and {prefix, suffix} around a model id: a model's queue keys
--                           are the default queues' keys with `prefix` replaced by model_prefix .. id
--   models, model_names     the registry: id -> record, name -> id (protocol/registry.py)
local function key(template, id) return template[1] .. id .. template[2] end

-- The layout of one model's queues ('' or nil: the default queues, L itself), derived once per script run.
local model_layouts = {}
local function model_layout(L, id)
  if not id or id == '' then return L end
  local M = model_layouts[id]
  if M then return M end
  local head = key(L.model_prefix, id)
  local function moved(k) return head .. string.sub(k, #L.prefix + 1) end
  M = {priorities = L.priorities, default_priority = L.default_priority, batch = L.batch,
       batch_jobs = L.batch_jobs, prefix = L.prefix, model_prefix = L.model_prefix, models = L.models,
       model_names = L.model_names, model = id, depth = moved(L.depth), wake = moved(L.wake),
       queue = {}, registry = {}, turn = {}, ready = {}, batch_queue = {}}
  for _, p in ipairs(L.priorities) do
    M.queue[p], M.registry[p] = moved(L.queue[p]), moved(L.registry[p])
    M.turn[p], M.ready[p] = moved(L.turn[p]), moved(L.ready[p])
    M.batch_queue[p] = {moved(L.batch_queue[p][1]), L.batch_queue[p][2]}
  end
  model_layouts[id] = M
  return M
end

-- The layout of the queues that queue q belongs to: a model's (its key starts with model_prefix .. id .. ':'),
-- else the default queues'.
local function layout_of_queue(L, q)
  local head = L.model_prefix and L.model_prefix[1]
  if head and q and string.sub(q, 1, #head) == head then
    local stop = string.find(q, ':', #head + 1, true)
    if stop then return model_layout(L, string.sub(q, #head + 1, stop - 1)) end
  end
  return L
end
