-- The gateway's byte reservation (capacity.py, kept_bytes.py). What an owner holds is its open reservations
-- (the queued-bytes hash: owner -> bytes, '*' -> all) plus its ledger of results kept: a hash of the end of an
-- hour -> bytes whose records expire before it, one per owner and one for all ('*'), trimmed here as hours pass.
--
-- kept_bytes(ledger, now): the ledger's bytes not yet expired; the hours that have ended are deleted.
local function kept_bytes(ledger, now)
  local sum, gone = 0, {}
  local all = redis.call('HGETALL', ledger)
  for i = 1, #all, 2 do
    if tonumber(all[i]) <= now then gone[#gone + 1] = all[i] else sum = sum + tonumber(all[i + 1]) end
  end
  if #gone > 0 then redis.call('HDEL', ledger, unpack(gone)) end
  return sum
end
-- keep_bytes(ledger, bytes, until, now): count bytes in a ledger until the hour ending at `until`; the ledger
-- itself expires with its last hour (an idle key's ledger goes).
local function keep_bytes(ledger, b, till, now)
  redis.call('HINCRBY', ledger, till, b)
  if redis.call('TTL', ledger) < till - now then redis.call('EXPIREAT', ledger, till) end
end
-- reserve_bytes(queued-bytes hash, owner, bytes, per-key limit, global limit (0 = none), owner's ledger, all's
-- ledger, now, until): until 0 = an open reservation (the queued-bytes hash; RELEASE_BYTES gives it back), else
-- kept in both ledgers until then. Returns 1, the owner's bytes after | -1, the owner's bytes (per-key limit) |
-- -2, all owners' bytes (global limit).
local function reserve_bytes(hash, owner, b, per_key, total, mine_ledger, all_ledger, now, till)
  local mine = tonumber(redis.call('HGET', hash, owner) or '0') + kept_bytes(mine_ledger, now)
  local all = tonumber(redis.call('HGET', hash, '*') or '0') + kept_bytes(all_ledger, now)
  if per_key > 0 and mine + b > per_key then return -1, mine end
  if total > 0 and all + b > total then return -2, all end
  if till > 0 then
    keep_bytes(mine_ledger, b, till, now)
    keep_bytes(all_ledger, b, till, now)
  else
    redis.call('HINCRBY', hash, owner, b)
    redis.call('HINCRBY', hash, '*', b)
  end
  return 1, mine + b
end
