-- A job that asked for a stream (its request has "stream": true) always ends its token stream
-- {ns}:job:{id}:tokens with a chunk marked done, however it ends, so a reader that waits for `done` never waits
-- forever. The worker writes the done chunk of a job it ran (PUBLISH_TOKENS); FINISH_JOB and CANCEL_JOB call
-- this as the job ends, and it adds an empty one (offset = tokens published so far, token_ids [], text '',
-- done 1) only when the stream's last chunk is not done: a job failed before it ran (model_mismatch,
-- invalid_request), cancelled while queued, or ended by a worker that published no done chunk.
-- tokens: the token stream's key (nil: an older caller passed none, nothing is written); request: its JSON.
local function end_stream(tokens, request, ttl)
  -- the cheap test first: most requests do not stream, and a finish must not decode a 1 MiB prompt for nothing
  if not tokens or not request or not string.find(request, '"stream"%s*:%s*true') then return end
  local ok, req = pcall(cjson.decode, request)
  if not ok or type(req) ~= 'table' or req.stream ~= true then return end
  local offset = 0
  local last = redis.call('XREVRANGE', tokens, '+', '-', 'COUNT', 1)[1]
  if last then
    local f = {}
    for i = 1, #last[2], 2 do f[last[2][i]] = last[2][i + 1] end
    if f.done == '1' then return end
    local ok_ids, ids = pcall(cjson.decode, f.token_ids or '[]')
    offset = (tonumber(f.offset) or 0) + ((ok_ids and type(ids) == 'table') and #ids or 0)
  end
  redis.call('XADD', tokens, '*', 'offset', offset, 'token_ids', '[]', 'text', '', 'done', '1')
  if ttl and ttl > 0 then redis.call('EXPIRE', tokens, ttl) end
end
