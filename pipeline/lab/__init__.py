"""The lab: measurements a person runs to learn what speculation is worth on a machine, each
printed and, with `--report`, written as a Markdown record and its JSON under docs/benchmarks/.
`bench` (`pipeline bench`: target-only against our engine's drafters, Hugging Face's assisted
generation and llama.cpp on the same documents, with α, τ, mean γ and predicted speedups),
`calibrate` (`pipeline calibrate`: pass costs at length, `--against` other weights, as a table
and a record; the measuring itself is the runtime's, `pipeline.decode.calibration`), `distill`
(`pipeline distill`: a draft fine-tuned on a run's own outputs, and its held-out evaluation),
`record` (the one header every record opens with: command, date, JSON link, machine and
commit) and `cli` (the three commands' options). Jobs never import the lab: it stands on the
engine, the models and the job's prompt building, never the other way round.
"""
