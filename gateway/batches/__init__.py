"""A batch's life in the gateway: create and list (service), its record and OpenAI object (records), quotas
and Redis capacity checked before anything is queued, the submit's lease and failures (ingest), the watcher
that notices its end, and its output and error lines (error_lines)."""
