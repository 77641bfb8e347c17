"""The job: from a spec to every shard's files. `executor` (the driver: plan, lease, dispatch,
record, manifest.json), `pool` (the model actors: free ones take shards, dead ones are
replaced), `worker` (the Ray model actor), `shard` (one shard end to end: read, decode,
write outputs, errors and stats), `stats` (the shard's stats record and the job's totals over
them), `speedup` (the measured speedup's pairs and interval), `layout` (where everything goes
under the output prefix, when a shard or a job is complete), `lease`, `fingerprint` (resume
checks), `ids` (duplicate ids across shards), `prompts`, `progress` (the terminal), `metrics`
(Ray/Prometheus metrics, recorded by the driver)."""
