"""Reading a job's results back: `results` (stats, rows and the terminal table), `figures`,
`html` (report.html), `quality` (scores against references)."""
