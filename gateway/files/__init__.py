"""Files: content on a volume, metadata in Redis (store), and the multipart upload streamed to disk (upload)."""
