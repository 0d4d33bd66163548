-- A job's request is stored once: in its queue entry, while the job waits or runs (SUBMIT_JOB writes no copy into
-- the record, so a record of short fields stays a compact listpack hash: docs/bench_million.md). Its entry is
-- deleted when the job ends, so FINISH_JOB first copies the request into the record, where readers of an ended
-- job (the batch export: model, logprobs) find it. CANCEL_JOB of a queued job does not: it never ran, and a
-- cancelled million-job batch must free its memory, not grow a copy per job. A record that holds a request
-- already (one written by an older client) keeps its own.
local function keep_request(record, stream, entry)
  if not entry or entry == '' or not stream or stream == '' then return end
  if redis.call('HEXISTS', record, 'request') == 1 then return end
  local found = redis.call('XRANGE', stream, entry, entry)[1]
  if not found then return end
  local fields = found[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'request' then
      redis.call('HSET', record, 'request', fields[i + 1])
      return
    end
  end
end
