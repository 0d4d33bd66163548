-- The gateway's byte reservation (capacity.py, kept_bytes.py, files/store.py, ui/session.py). What an owner holds
-- is its open reservations (the queued-bytes hash: owner -> bytes, '*' -> all) plus its ledger of what Redis
-- keeps for it: a hash of the end of an hour -> bytes whose records expire before it (results, dashboard
-- sessions), trimmed here as hours pass, and 'held' -> bytes of records kept until they are deleted (files'
-- metadata, ended batches' records); one ledger per owner and one for all ('*').
local HELD = 'held'
--
-- kept_bytes(ledger, now): the ledger's bytes not yet expired; the hours that have ended are deleted.
local function kept_bytes(ledger, now)
  local sum, gone = 0, {}
  local all = redis.call('HGETALL', ledger)
  for i = 1, #all, 2 do
    if all[i] ~= HELD and tonumber(all[i]) <= now then gone[#gone + 1] = all[i] else sum = sum + tonumber(all[i + 1]) end
  end
  if #gone > 0 then redis.call('HDEL', ledger, unpack(gone)) end
  return sum
end
-- keep_bytes(ledger, bytes, until, now): count bytes in a ledger until the hour ending at `until` (HELD: until
-- they are given back). The ledger expires with its last hour (an idle key's ledger goes), never while it
-- counts held bytes.
local function keep_bytes(ledger, b, till, now)
  redis.call('HINCRBY', ledger, till, b)
  if till == HELD then
    redis.call('PERSIST', ledger)
  elseif redis.call('HEXISTS', ledger, HELD) == 0 and redis.call('TTL', ledger) < till - now then
    redis.call('EXPIREAT', ledger, till)
  end
end
-- unkeep_bytes(ledger, bytes, until): give back bytes kept, once what they count has ended before its time (a
-- logout, a file deleted). A field gone already (its hour ended, or the ledger was emptied) gives back nothing;
-- nothing goes below 0. A ledger left without held bytes expires with its last hour again.
local function unkeep_bytes(ledger, b, till)
  if b <= 0 or redis.call('HEXISTS', ledger, till) == 0 then return end
  if redis.call('HINCRBY', ledger, till, -b) > 0 then return end
  redis.call('HDEL', ledger, till)
  if till == HELD then
    local last = 0
    for _, hour in ipairs(redis.call('HKEYS', ledger)) do last = math.max(last, tonumber(hour)) end
    if last > 0 then redis.call('EXPIREAT', ledger, last) end
  end
end
-- drop_counted(record, bytes field, until field, owner's ledger, all's ledger): delete a record and give back
-- what its fields say it was counted (unkeep_bytes); returns the bytes (0: gone already, or never counted).
local function drop_counted(record, bytes_field, until_field, mine_ledger, all_ledger)
  local f = redis.call('HMGET', record, bytes_field, until_field)
  local b = tonumber(f[1] or '') or 0
  redis.call('DEL', record)
  if f[2] then
    unkeep_bytes(mine_ledger, b, f[2])
    unkeep_bytes(all_ledger, b, f[2])
  end
  return b
end
-- reserve_bytes(queued-bytes hash, owner, bytes, per-key limit, global limit (0 = none), owner's ledger, all's
-- ledger, now, until, credit): until 0 = an open reservation (the queued-bytes hash; RELEASE_BYTES gives it
-- back), else kept in both ledgers until then (HELD: until given back). `credit` (default 0) is what the
-- caller frees in the same step if this succeeds (a login ending the key's oldest session). Returns 1, the
-- owner's bytes after | -1, the owner's bytes (per-key limit) | -2, all owners' bytes (global limit).
local function reserve_bytes(hash, owner, b, per_key, total, mine_ledger, all_ledger, now, till, credit)
  credit = credit or 0
  local mine = tonumber(redis.call('HGET', hash, owner) or '0') + kept_bytes(mine_ledger, now) - credit
  local all = tonumber(redis.call('HGET', hash, '*') or '0') + kept_bytes(all_ledger, now) - credit
  if per_key > 0 and mine + b > per_key then return -1, mine end
  if total > 0 and all + b > total then return -2, all end
  if till ~= 0 then
    keep_bytes(mine_ledger, b, till, now)
    keep_bytes(all_ledger, b, till, now)
  else
    redis.call('HINCRBY', hash, owner, b)
    redis.call('HINCRBY', hash, '*', b)
  end
  return 1, mine + b
end
