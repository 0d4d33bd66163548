-- reserve_bytes(queued-bytes hash, owner, bytes, per-key limit, global limit (0 = none)): the gateway's byte
-- reservation (capacity.py). Returns 1, the owner's bytes after | -1, the owner's bytes (per-key limit) |
-- -2, all owners' bytes (global limit).
local function reserve_bytes(hash, owner, b, per_key, total)
  local mine = tonumber(redis.call('HGET', hash, owner) or '0')
  local all = tonumber(redis.call('HGET', hash, '*') or '0')
  if per_key > 0 and mine + b > per_key then return -1, mine end
  if total > 0 and all + b > total then return -2, all end
  redis.call('HINCRBY', hash, owner, b)
  redis.call('HINCRBY', hash, '*', b)
  return 1, mine + b
end
