-- DECLARE_MODEL (worker at start; the operator's `tokenbus models add`)
-- Declare a model: its record under its id in {ns}:models, each of its names -> its id in {ns}:model-names, and
-- the namespace's default model when none is set yet (the first declared). A name another model holds stays
-- that model's: when that model's checkpoint is another one, nothing is written and the declaration is refused;
-- when it is the same checkpoint (or one declared by hand, with none yet), the declarer serves that model too.
-- Repeating a declaration changes nothing more: a record keeps its first declared_at and declared_by.
-- KEYS: 1 {ns}:models, 2 {ns}:model-names, 3 {ns}:config
-- ARGV: 1 the record (JSON: id, names (the id first), kind, checkpoint ('' = not known: by hand),
--       context_length, parent (a LoRA adapter's base), root, declared_at, declared_by), 2 the config field
--       naming the default model
-- returns {1, id, other model ids it serves...} | {-1, name, the model holding it, that model's checkpoint}
local new = cjson.decode(ARGV[1])
local asked, ck = new.id, new.checkpoint or ''
local function record(model)
  local raw = redis.call('HGET', KEYS[1], model)
  if raw then return cjson.decode(raw) end
  return nil
end
-- an id that is already another model's name (an alias) is that model
local id = redis.call('HGET', KEYS[2], asked) or asked
new.id = id
local cur = record(id)
if cur and (cur.checkpoint or '') ~= '' and ck ~= '' and cur.checkpoint ~= ck then
  return {-1, asked, id, cur.checkpoint}
end
local mine, also, seen = {}, {}, {}
for _, name in ipairs(new.names) do
  local owner = redis.call('HGET', KEYS[2], name)
  if owner and owner ~= id then
    local other = record(owner)
    local theirs = (other and other.checkpoint) or ''
    if theirs ~= '' and ck ~= '' and theirs ~= ck then return {-1, name, owner, theirs} end
    if other and not seen[owner] then
      seen[owner] = true
      table.insert(also, owner)
      if theirs == '' and ck ~= '' then
        other.checkpoint = ck
        redis.call('HSET', KEYS[1], owner, cjson.encode(other))
      end
    end
  else
    table.insert(mine, name)
  end
end
local out = new
out.names = mine
if cur then
  out = cur
  local known = {}
  for _, n in ipairs(cur.names or {}) do known[n] = true end
  for _, n in ipairs(mine) do
    if not known[n] then table.insert(out.names, n) end
  end
  if (cur.checkpoint or '') == '' then out.checkpoint = ck; out.parent = new.parent end
  if out.root == nil then out.root = new.root end
  if new.context_length ~= nil and new.context_length ~= cjson.null then out.context_length = new.context_length end
end
for _, n in ipairs(mine) do redis.call('HSET', KEYS[2], n, id) end
redis.call('HSET', KEYS[1], id, cjson.encode(out))
-- an adapter never becomes the default: the default queues' jobs name no adapter
if not out.parent or out.parent == cjson.null then redis.call('HSETNX', KEYS[3], ARGV[2], id) end
return {1, id, unpack(also)}
