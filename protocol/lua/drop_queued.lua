-- DROP_QUEUED (gateway, ingest.py): undo a partial ingest.
-- KEYS: job records. Deletes those still queued (never started): their memory comes back at once, and a worker
-- that reads their stream entry later finds no record and skips it. DEL is allowed when Redis is out of memory.
-- returns how many were deleted
local n = 0
for _, k in ipairs(KEYS) do
  if redis.call('HGET', k, 'status') == 'queued' then redis.call('DEL', k); n = n + 1 end
end
return n
