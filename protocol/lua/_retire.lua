-- retire(models, model_names, config, id, record, default_field): a model's record and every name of it out of
-- the registry, and the namespace's default model unset when it was this one (RETIRE_MODEL, ADAPTER_REMOVE).
local function retire(models, model_names, config, id, rec, default_field)
  for _, name in ipairs(rec.names or {}) do
    if redis.call('HGET', model_names, name) == id then redis.call('HDEL', model_names, name) end
  end
  redis.call('HDEL', models, id)
  if redis.call('HGET', config, default_field) == id then redis.call('HDEL', config, default_field) end
end
