-- START_JOB (worker)
-- KEYS: 1 record, 2 the queue (stream) the entry was read from
-- ARGV: 1 group, 2 entry_id, 3 worker name, 4 now, 5 the namespace's layout (JSON, _layout.lua: the depth counter)
-- returns {'running', attempts} (run it) | {status, 0} terminal: skip (entry acked+deleted)
--       | {'missing', 0} no record (expired or never submitted): skip (entry acked+deleted)
-- #include _is_terminal.lua
-- #include _queue_depth.lua
local status = redis.call('HGET', KEYS[1], 'status')
if (not status) or is_terminal(status) then
  local M = layout_of_queue(cjson.decode(ARGV[5]), KEYS[2])  -- the depth counter of the entry's model
  depth_init(M)
  ack_del(M, KEYS[2], ARGV[1], ARGV[2])
  return {status or 'missing', 0}
end
redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[4], 'worker', ARGV[3],
           'entry_id', ARGV[2], 'queue', KEYS[2])
redis.call('HDEL', KEYS[1], 'first_token_at')
return {'running', redis.call('HINCRBY', KEYS[1], 'attempts', 1)}
