-- ADAPTER_ADD (the operator's `tokenbus adapters add`)
-- Ask the workers of a base model to serve a LoRA adapter under a model name of its own: the adapter's entry in
-- {ns}:adapters (field = its name, value = {name, base, path, state "added", rev, at}) and the hash's revision
-- (field ':rev', which no model name can be: names hold no ':') one higher. The base's workers poll the
-- revision, load the directory, declare the adapter (DECLARE_MODEL, the base as its parent) and confirm in their
-- heartbeats (adapters, adapter_errors, adapters_rev). Repeating it with the same base and path writes nothing.
-- KEYS: 1 {ns}:adapters, 2 {ns}:models, 3 {ns}:model-names
-- ARGV: 1 the adapter's name, 2 the base model (any of its names), 3 the adapter's directory (as the workers
--       see it), 4 now (epoch seconds)
-- returns {1, rev, base id} written | {0, rev, base id} already so | {-1, JSON list of the declared ids} no
--         such base | {-2, base id} the base is itself an adapter | {-3, owner} the name is another model's
local name, path = ARGV[1], ARGV[3]
local base = redis.call('HGET', KEYS[3], ARGV[2])
local raw = base and redis.call('HGET', KEYS[2], base)
if not raw then return {-1, cjson.encode(redis.call('HKEYS', KEYS[2]))} end
local parent = cjson.decode(raw).parent
if parent and parent ~= cjson.null then return {-2, base} end
local owner = redis.call('HGET', KEYS[3], name)
if owner then
  local other = cjson.decode(redis.call('HGET', KEYS[2], owner) or '{}')
  if other.parent ~= base then return {-3, owner} end
end
local rev = tonumber(redis.call('HGET', KEYS[1], ':rev') or '0')
local cur = redis.call('HGET', KEYS[1], name)
if cur then
  local c = cjson.decode(cur)
  if c.state == 'added' and c.base == base and c.path == path then return {0, rev, base} end
end
rev = redis.call('HINCRBY', KEYS[1], ':rev', 1)
redis.call('HSET', KEYS[1], name,
  cjson.encode({name = name, base = base, path = path, state = 'added', rev = rev, at = tonumber(ARGV[4])}))
return {1, rev, base}
