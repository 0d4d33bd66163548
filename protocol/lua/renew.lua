-- RENEW (worker)
-- Reset the idle time (the lease) of the entries this consumer still owns; report the others as lost
-- (reclaimed by another worker after our lease lapsed, acknowledged already, or their queue is gone). XCLAIM
-- alone would steal an entry back from the worker that reclaimed it, hence the ownership check.
-- KEYS: the queue (stream) of each entry: KEYS[i] holds ARGV[i + 2]. ARGV: 1 group, 2 consumer, 3.. entry ids
-- returns the entry ids it no longer holds (reclaimed by another worker, or acked): the others' idle time is 0
local lost = {}
for i = 3, #ARGV do
  local q, id = KEYS[i - 2], ARGV[i]
  local pending = redis.pcall('XPENDING', q, ARGV[1], id, id, 1, ARGV[2])
  if type(pending) ~= 'table' or pending.err or #pending == 0 then
    table.insert(lost, id)
  else
    redis.call('XCLAIM', q, ARGV[1], ARGV[2], 0, id, 'JUSTID')
  end
end
return lost
