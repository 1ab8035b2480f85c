"""The job kit: what every job of model actors over a stream of records shares (`extract`, `regenerate`).

A job is these steps, each a module here; the job itself says only what is its own (what a record is,
what its actor does with a chunk, what it commits):

| step | module |
|---|---|
| read: files -> records, rejects with file and line, one counting pass then a stream | `records`, `record_stream` |
| identity: the target's fingerprint and the digest of what the output depends on | `identity` |
| lock: one job per output (a store has `pipeline.store`'s lock) | `outputs` (`output_lock`) |
| chunk plan: chunks in input order, kept when committed earlier, else handed on | `plan` (`chunked`, `run_chunks`) |
| actor dispatch: persistent Ray actors, a bounded number of chunks in flight | `dispatch`, `ray_session` |
| commit: a whole output file or nothing; rejects in input order | `outputs` (`write_lines`), `rejects` |
| summary: progress while it runs, the closing lines | `progress`, `cli` |
"""
