"""Running on a Ray cluster: `jobs_api` (submit and follow jobs through the Ray Jobs API).
The Ray custom metrics a job exports are recorded by its driver: `pipeline.job.metrics`."""
