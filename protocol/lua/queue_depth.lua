-- QUEUE_DEPTH (client)
-- KEYS: none (the queues are found from the layout). ARGV: 1 the namespace's layout (JSON, _layout.lua).
-- Returns the entries in every queue.
-- #include _queue_depth.lua
return queue_depth(cjson.decode(ARGV[1]))
