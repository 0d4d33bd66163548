-- BUMP_BATCH (client)
-- KEYS: 1 {ns}:config, only to route the call to the namespace's shard on a Redis Cluster (nothing is read from
--       it; on a single Redis a call with no KEYS works too).
-- ARGV: 1 the namespace's layout (JSON, _layout.lua), 2 batch_id, 3 status, 4 now, 5 ttl.
-- Counts a job that will never run.
-- #include _bump_batch.lua
bump_batch(cjson.decode(ARGV[1]), ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]))
return 1
