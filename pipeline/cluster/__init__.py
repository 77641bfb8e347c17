"""Running on a Ray cluster: `jobs_api` (submit and follow jobs through the Ray Jobs API),
`metrics` (Ray custom metrics for the dashboard and Prometheus)."""
